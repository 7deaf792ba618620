"""Stop signals in one process: held while fit starts, taken over by StopSignals, insisted on."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hvdtrain.train import early_signals
from hvdtrain.train.stop_policy import StopSignals


def test_a_signal_held_while_starting_is_the_stop_signal_of_training():
    before = signal.getsignal(signal.SIGUSR1)
    early_signals.hold()
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    with StopSignals("SIGTERM,SIGUSR1") as signals:
        assert signals.received == signal.SIGUSR1
        assert signal.getsignal(signal.SIGUSR1) == signals._note  # no moment without a handler
    early_signals.restore()  # as fit does when it returns
    assert signal.getsignal(signal.SIGUSR1) == before  # what there was before fit, not the holder


def test_a_held_signal_that_is_not_a_stop_signal_acts_when_training_begins():
    done = subprocess.run([sys.executable, "-c", (
        "import os, signal, time\n"
        "from hvdtrain.train import early_signals\n"
        "from hvdtrain.train.stop_policy import StopSignals\n"
        "early_signals.hold(); os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.01)\n"
        "print('held', flush=True)\n"
        "with StopSignals('SIGTERM'): print('not reached', flush=True)\n")], capture_output=True, text=True)
    assert done.returncode == -signal.SIGUSR1 and done.stdout == "held\n", done


def test_a_held_signal_repeated_later_ends_the_process_as_its_default_would():
    done = subprocess.run([sys.executable, "-c", (
        "import os, signal, time\n"
        "from hvdtrain.train import early_signals\n"
        "early_signals.hold(); os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.01)\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.01); print('same delivery', flush=True)\n"
        "time.sleep(early_signals.SAME_DELIVERY_SECONDS)\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.5); print('not reached', flush=True)\n")],
        capture_output=True, text=True)
    assert done.returncode == -signal.SIGUSR1 and done.stdout == "same delivery\n", done


def test_the_sigterm_of_torchrun_s_agent_dying_during_a_stop_does_not_insist():
    """A stop under way (here SIGUSR1's) when torchrun's agent dies: the SIGTERM of its death is no
    second signal from a user, which would end the worker in the stop's checkpoint. A worker's own
    parent, here this test, stands in for the agent."""
    done = subprocess.run([sys.executable, "-c", (
        "import os, signal, time\n"
        "import hvdtrain\n"
        "from hvdtrain.train.stop_policy import StopSignals\n"
        "with StopSignals('SIGTERM,SIGUSR1') as signals:\n"
        "    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.01)\n"
        "    hvdtrain.PARENT_AT_START = -1  # as after the agent died\n"
        "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "    print('still stopping', signals.received == signal.SIGUSR1, flush=True)\n")],
        env={**os.environ, "TORCHELASTIC_RUN_ID": "test"}, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "still stopping True\n", done


def test_two_stop_signals_at_once_are_one_stop_and_a_later_one_ends_the_command_with_a_word_for_runs(tmp_path):
    """A logout sends SIGTERM with the terminal's SIGHUP: one stop, not a second signal that insists. One
    later does, and ends the command as its default would; `hvdtrain runs` reads how in the lock's note.
    (SIGHUP has its default, as in a login session's process, even where the tests run under nohup.)"""
    import json

    done = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from hvdtrain.io import run_lock\n"
        "from hvdtrain.train import early_signals\n"
        "from hvdtrain.train.stop_policy import StopSignals\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "early_signals.in_the_command_s_process()\n"
        "run_lock.claim(Path(sys.argv[1]))\n"
        "with StopSignals('SIGTERM,SIGHUP') as signals:\n"
        "    os.kill(os.getpid(), signal.SIGHUP); time.sleep(0.01)\n"
        "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.01)\n"
        "    print('one stop', signals.received == signal.SIGHUP, flush=True)\n"
        "    time.sleep(early_signals.SAME_DELIVERY_SECONDS)\n"
        "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.5)\n"
        "    print('not reached', flush=True)\n"), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == -signal.SIGTERM and done.stdout == "one stop True\n", done
    assert json.loads((tmp_path / ".hvdtrain.lock").read_text()) == {"ended": "ended by a second SIGTERM"}


def test_a_failed_rank_waiting_for_rank_0_s_word_outlives_a_warning_signal_but_not_ctrl_c_or_the_launcher():
    """A rank other than 0 about to report a failure waits for rank 0's line (rank 0 failing alike ends the
    job first; the wait of a failure mid-run and of a quiet rank's error alike). A scheduler's SIGUSR1
    meanwhile must not end it without its own line, the only one where rank 0 did not fail; a Ctrl-C ends
    the wait, and the rank says its line and exits at once (a 30 s wait deaf to Ctrl-C would hold the job:
    rank 0 may wait in native code, which runs no handler). The launcher's SIGTERM ends it as it is."""
    def python(script: str) -> tuple[subprocess.CompletedProcess, float]:
        """As rank 1 of an Open MPI job, told to wait 60 s for rank 0: what it did, and in how many seconds."""
        env = {**os.environ, "OMPI_COMM_WORLD_RANK": "1", "HVDTRAIN_QUIET_RANK_WAIT_SECONDS": "60"}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90)
        return done, time.monotonic() - started

    quiet = ("import os, signal, threading\n"
             "from hvdtrain.cli import common\n"
             "from hvdtrain.engine import environment  # loaded, as in a rank that got as far as a launcher's\n"
             "signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, whatever pytest's worker left\n"
             "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()\n"
             "threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
             "try:\n"
             "    common.fail('config key x must be an integer', 2, debug=False)\n"
             "finally:\n"
             "    print('handlers back', signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,\n"
             "          signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)\n")
    done, seconds = python(quiet)
    assert done.returncode == 2 and done.stderr == "hvdtrain: error: rank 1: config key x must be an integer\n", done
    assert done.stdout == "handlers back True True\n" and seconds < 30, done  # not the 60 s
    # A handler that only notes the signal, as a stop handler left from fit would: the rank must still end at
    # once, or the launcher's SIGKILL 5 s later made it the job's failure ("worker 1 was killed by SIGKILL")
    launcher = ("import os, signal, threading\n"
                "from hvdtrain.cli import common\n"
                "signal.signal(signal.SIGTERM, lambda number, frame: print('noted', flush=True))\n"
                "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
                "common._wait_for_rank_0_s_word(30.0, quiet=True)\n"
                "print('not reached', flush=True)\n")
    done, _ = python(launcher)
    assert done.returncode == -signal.SIGTERM and done.stdout == "", done
    # The launcher's SIGTERM came while fit was still failing (rank 0 said the error and left first), and
    # fit's stop handler noted it: the wait must act on it at once, not sit out its time for a SIGKILL.
    failing_fit = ("import os, signal\n"
                   "from hvdtrain.cli import common\n"
                   "from hvdtrain.train import early_signals\n"
                   "from hvdtrain.train.stop_policy import StopSignals\n"
                   "early_signals.in_the_command_s_process()\n"
                   "try:\n"
                   "    with StopSignals('SIGTERM,SIGINT'):\n"
                   "        os.kill(os.getpid(), signal.{})\n"
                   "        raise FloatingPointError('non-finite loss')\n"
                   "except FloatingPointError:\n"
                   "    {}\n")
    for wait in ("common.fail('non-finite loss at step 7 on rank 1', 1, debug=False)",  # quiet: rank 0 says it
                 "common._wait_for_rank_0_s_word(60.0); print('said', flush=True)"):  # a line of its own
        done, seconds = python(failing_fit.format("SIGTERM", wait))
        assert done.returncode == -signal.SIGTERM and done.stdout + done.stderr == "" and seconds < 30, done
    # A Ctrl-C noted so ends the wait at once as well, and the rank says its line and leaves.
    done, seconds = python(failing_fit.format("SIGINT", "common._wait_for_rank_0_s_word(60.0); print('said')"))
    assert done.returncode == 0 and done.stdout == "said\n" and seconds < 30, done


def test_a_process_forked_from_a_torchrun_worker_has_its_own_parent(monkeypatch):
    """A script that imported hvdtrain and forks (multiprocessing's default on Linux) runs fit in a child
    whose parent is the worker, not the agent: that is no agent's death."""
    from hvdtrain.engine.parent_death import agent_gone

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    child = os.fork()
    if child == 0:
        os._exit(1 if agent_gone() else 0)
    assert os.waitpid(child, 0)[1] == 0


def test_a_rank_stopping_on_another_rank_s_signal_survives_its_own_copy_coming_late():
    """Every rank stops at one step when any rank got the signal; torchrun's agent passes the signal to one
    worker after another, so a rank may get its copy after it left training. It stops as it was going to."""
    done = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys, time\n"
        "from hvdtrain.errors import StoppedBySignal\n"
        "from hvdtrain.train.stop_policy import StopSignals\n"
        "try:\n"
        "    with StopSignals('SIGTERM,SIGUSR1'):\n"
        "        raise StoppedBySignal('stopped by SIGUSR1 on rank 0')\n"
        "except StoppedBySignal:\n"
        "    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
        "    print('stopping', flush=True); sys.exit(75)\n")], capture_output=True, text=True)
    assert done.returncode == 75 and done.stdout == "stopping\n", done


def test_after_training_to_the_end_the_scheduler_s_warning_signal_is_ignored_until_the_exit():
    """Slurm's --signal may come once training is over, while the engine shuts down or the interpreter
    ends: nothing is left to stop, so the process ends as it was going to, not killed by it. A signal
    that means 'end now' (SIGTERM) keeps its default."""
    done = subprocess.run([sys.executable, "-c", (
        "import atexit, os, signal, sys, time\n"
        "from hvdtrain.train import early_signals\n"
        "from hvdtrain.train.stop_policy import StopSignals\n"
        "early_signals.hold()\n"
        "with StopSignals('SIGTERM,SIGUSR1'): pass\n"
        "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.05)\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGUSR1), time.sleep(0.05)))\n"
        "print('finished', flush=True)\n")], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "finished\n", done


def test_without_hold_training_s_end_gives_the_handlers_back_at_once():
    """train.fit.fit called directly (no fit_from to restore later): nothing is left ignored."""
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals("SIGTERM,SIGUSR1"):
        pass
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_python_api_gets_its_own_signal_handlers_back_after_fit():
    def mine(number, frame):
        pass

    before = signal.signal(signal.SIGUSR1, mine)
    try:
        early_signals.hold()
        with StopSignals("SIGTERM,SIGUSR1"):
            pass
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # until fit returns
        early_signals.restore()
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, before)


STOPPED_IN_A_NOTEBOOK = """
import os, signal, sys, time
import hvdtrain
from hvdtrain.errors import StoppedBySignal

class CtrlC:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGINT)

def ctrl_c():
    try:
        os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "nothing"

settings = dict(model="mlp", data="random", epochs=2, progress="off", run_dir=sys.argv[1],
                overrides={"run.stop_check_seconds": 0, "data.samples": 512})
def handlers():
    return (signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL)

try:
    hvdtrain.fit(callbacks=[CtrlC(2)], **settings)
except StoppedBySignal as stopped:
    print("stopped:", stopped)
print("a late copy:", ctrl_c())
time.sleep(2.1)
print("Ctrl-C later:", ctrl_c())
print("handlers:", handlers())
try:  # stopped again, then resumed at once: no signal in between gives the handlers back
    hvdtrain.fit(resume=True, callbacks=[CtrlC(4)], **settings)
except StoppedBySignal as stopped:
    print("stopped:", stopped)
hvdtrain.fit(resume=True, **settings)
print("after the resume:", handlers(), ctrl_c())
from hvdtrain.train.stop_policy import StopSignals
try:
    with StopSignals("SIGINT,SIGTERM"):  # as while training: the first noted, a repeat later insists
        print("while training:", ctrl_c())
        time.sleep(2.1)
        print("insisting:", ctrl_c())
except KeyboardInterrupt:
    print("KeyboardInterrupt out of training")
print("at the end:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_python_session_stopped_by_ctrl_c_gets_its_own_handlers_back(tmp_path):
    """hvdtrain.fit stopped by Ctrl-C in a notebook or a script that goes on: the late copy of that signal
    (a launcher's) is absorbed, the next Ctrl-C is Python's KeyboardInterrupt again (it killed the process),
    and a second fit in the same process gives back the same handlers; Ctrl-C insisting while training is a
    KeyboardInterrupt too."""
    done = subprocess.run([sys.executable, "-c", STOPPED_IN_A_NOTEBOOK, str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=120, preexec_fn=_as_a_terminal_starts_it)
    assert done.returncode == 0, done
    lines = [line for line in done.stdout.splitlines() if not line.startswith(("epoch", "hvdtrain:"))]
    assert lines == ["stopped: stopped by SIGINT at epoch 1, step 2: checkpoint written; continue with --resume",
                     "a late copy: nothing", "Ctrl-C later: KeyboardInterrupt", "handlers: (True, True)",
                     "stopped: stopped by SIGINT at epoch 1, step 4: checkpoint written; continue with --resume",
                     "after the resume: (True, True) KeyboardInterrupt", "while training: nothing",
                     "insisting: KeyboardInterrupt", "at the end: True"], done


def test_a_script_that_leaves_the_stop_uncaught_exits_as_the_command_does(tmp_path):
    """A script's fit stopped by SIGTERM, StoppedBySignal not caught: the command's one line and status 75
    (a requeue script's sign of a stop with a checkpoint), not a traceback and status 1 from every rank."""
    script = ("import os, signal, sys\nimport hvdtrain\n"
              "class Term:\n    def on_step_end(self, state):\n"
              "        if state.step == 2:\n            os.kill(os.getpid(), signal.SIGTERM)\n"
              "hvdtrain.fit(model='mlp', data='random', epochs=2, progress='off', run_dir=sys.argv[1], callbacks=[Term()],"
              " overrides={'run.stop_check_seconds': 0, 'data.samples': 512})\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 75, done
    assert done.stderr.splitlines()[-1] == "hvdtrain: stopped by SIGTERM at epoch 1, step 2: checkpoint written; " \
                                           "continue with --resume", done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_script_s_uncaught_bad_input_is_one_line_after_its_threads_and_a_session_goes_on(tmp_path):
    """A script's uncaught UserError: the command's one line and status 2, once the script's own thread (not a
    daemon: Python waits for it) has done its work. A UserError the script raises itself, and any error in an
    interactive session (which goes on), are Python's own (the hook had taken both as fit's, ending the session)."""
    written = tmp_path / "uploaded"
    script = ("import sys, threading, time\nimport hvdtrain\n"
              "threading.Thread(target=lambda: (time.sleep(6), open(sys.argv[1], 'w').write('done'))).start()\n"
              "hvdtrain.fit(model='nosuchmodel', data='random', progress='off')\n")
    done = subprocess.run([sys.executable, "-c", script, str(written)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 2 and written.read_text() == "done", done
    assert done.stderr.splitlines()[-1].startswith("hvdtrain: error: unknown model 'nosuchmodel'"), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # The script's own UserError, after fit's was caught, keeps Python's way: the traceback to its line.
    own = subprocess.run([sys.executable, "-c", "import hvdtrain\ntry:\n    hvdtrain.fit(model='nosuchmodel')\n"
                          "except hvdtrain.UserError:\n    pass\nraise hvdtrain.UserError('results.csv has no acc')\n"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert own.returncode == 1 and own.stderr.splitlines()[-1] == "hvdtrain.errors.UserError: results.csv has no " \
                                                                   "acc", own.stderr
    session = subprocess.run([sys.executable, "-i"], input="import hvdtrain\nhvdtrain.fit(model='nosuchmodel')\n"
                             "print('still here')\n", capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert session.returncode == 0 and "still here" in session.stdout, session
    assert "hvdtrain.errors.UserError: unknown model 'nosuchmodel'" in session.stderr, session.stderr


def test_the_fit_command_holds_the_scheduler_s_warning_before_it_loads_anything_heavy():
    """Slurm's --signal may reach a task within its first second: `hvdtrain fit` notes SIGUSR1 from its
    entry point on, before click, the config, YAML or torch load (until then the default kills it); the
    other commands leave it alone."""
    spy = (
        "import sys\n"
        "from hvdtrain.train import early_signals\n"
        "held = early_signals.hold\n"
        "def hold():\n"
        "    loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('click', 'yaml', 'torch', 'hvdtrain'))\n"
        "    print('held with', loaded, flush=True)\n"
        "    held()\n"
        "early_signals.hold = hold\n"
        "sys.argv = ['hvdtrain', *sys.argv[1:]]\n"
        "from hvdtrain.cli import main\n"
        "main()\n")
    fit = subprocess.run([sys.executable, "-c", spy, "fit", "--epochs", "none"], capture_output=True, text=True)
    assert fit.returncode == 2 and "'none' is not a valid integer" in fit.stderr, fit
    assert fit.stdout.splitlines()[0] == (
        "held with ['hvdtrain', 'hvdtrain.cli', 'hvdtrain.train', 'hvdtrain.train.early_signals']"), fit
    shown = subprocess.run([sys.executable, "-c", spy, "config"], capture_output=True, text=True)
    assert shown.returncode == 0 and "held with" not in shown.stdout and "train:" in shown.stdout, shown


INTERRUPTED_INSIDE_TORCH = '''
import importlib.abc, pathlib, sys, time
class _Pause(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch.nn":  # half way through torch's own import, its C library loaded
            sys.meta_path.remove(self)
            pathlib.Path(r"{marker}").touch()
            time.sleep(5)
        return None
sys.meta_path.insert(0, _Pause())
'''


def _as_a_terminal_starts_it() -> None:
    """SIGINT at its default and not blocked, as a shell in a terminal starts a command: the process that
    runs the tests may have inherited it ignored (a job started in the background) or have it blocked."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_while_fit_imports_torch_is_one_line_and_status_130(tmp_path):
    """Ctrl-C that cuts torch's import short: importing torch again (to learn the rank) or tearing it
    down at exit crashed (a segfault, or tracebacks of a half-loaded torch); now one line, 130."""
    marker = tmp_path / "inside-torch"
    (tmp_path / "sitecustomize.py").write_text(INTERRUPTED_INSIDE_TORCH.format(marker=marker))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = subprocess.Popen([sys.executable, "-m", "hvdtrain", "fit", "--data", "random", "--epochs", "1",
                            "--run-dir", str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, preexec_fn=_as_a_terminal_starts_it)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.01)
    assert marker.exists(), job.communicate()
    masks = [line for line in Path(f"/proc/{job.pid}/status").read_text().splitlines() if line.startswith("Sig")]
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 130 and err.strip() == "hvdtrain: error: interrupted", (job.returncode, out, err, masks)
    assert not (tmp_path / "run").exists()


AT_THE_END = '''
import atexit, os, sys, threading, time
atexit.register(lambda: print("exit handlers ran", flush=True))
class _Module:
    def __del__(self):
        print("torn down", flush=True)
sys.modules["a_module_torn_down_at_exit"] = _Module()
if os.environ.get("A_THREAD_OF_THE_USER"):
    # alive until the main thread has ended, however long the command takes on a loaded host
    threading.Thread(target=lambda: (threading.main_thread().join(), time.sleep(0.1),
                                     print("the user's thread ended", flush=True))).start()
'''


def test_the_command_ends_with_its_exit_handlers_but_without_the_interpreter_s_teardown(tmp_path):
    """Freeing torch's modules at exit costs a rank up to 0.7 s of a core: the command ends once its exit
    handlers ran (Horovod's shutdown, MPI_Finalize and flushes are among them), its status kept; a thread
    of the user's that is not a daemon is still waited for, the interpreter ending as it would."""
    (tmp_path / "sitecustomize.py").write_text(AT_THE_END)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    shown = subprocess.run([sys.executable, "-m", "hvdtrain", "config"], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.endswith("exit handlers ran\n"), shown.stdout[-300:]
    refused = subprocess.run([sys.executable, "-m", "hvdtrain", "fit", "--epochs", "none"], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == "exit handlers ran\n", refused
    waited = subprocess.run([sys.executable, "-m", "hvdtrain", "config"], env={**env, "A_THREAD_OF_THE_USER": "1"},
                            capture_output=True, text=True)
    assert waited.returncode == 0 and waited.stdout.endswith(
        "the user's thread ended\nexit handlers ran\ntorn down\n"), waited.stdout[-300:]

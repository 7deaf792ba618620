"""The `horovodrun` and `torchrun` entries that launch/install.sh puts in the environment.

Each runs the launcher it is named after unchanged. The only difference: when a worker
fails, Horovod's Gloo launcher and torchrun each raise and print a traceback and a
report of their own under the worker's one-line error; here that report is one line
too, and names the worker that failed first, with its exit status: not a rank that stopped only
because its collective broke off (status 76, hvdtrain.errors.ANOTHER_RANK_FAILED), even where that
rank left first. torchrun also takes `hvdtrain` as the program
(`torchrun --nproc-per-node 2 hvdtrain fit`), which it would otherwise look for as a
Python file in the current directory.

Both also pass a stop signal on to the ranks (`forwarding`) and wait for them, so that they can
stop at one step with a checkpoint: horovodrun itself died of SIGTERM and left mpirun and every rank
training, and torchrun raised a traceback and exited 1. The exit status is then the ranks' (75
after a clean stop).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from typing import Any

from hvdtrain.cli import elastic_launch, forwarding
from hvdtrain.cli.forwarding import forward_to_ranks
from hvdtrain.cli.gloo_workers import STOPPED_GRACE_SECONDS, GlooWorkers
from hvdtrain.cli.launcher_arguments import check_torchrun_sizes, checked, refuse, said
from hvdtrain.cli.leaving import leave_without_teardown
from hvdtrain.cli.mpirun_child import MpirunAsChild
from hvdtrain.cli.outcome import ANOTHER_RANK_FAILED, STOPPED, outcome
from hvdtrain.errors import UserError

FAILED_JOB_GRACE_SECONDS = 5
_KILLED_BY_THE_AGENT: set[int] = set()  # torchrun: the workers' pids its agent killed past the grace


def horovodrun() -> None:
    """Horovod's horovodrun, as the module's docstring says; output read by a reader that left (`horovodrun
    --check-build | head -1`, whose print may wait in the buffer of a pipe until the exit) is no traceback."""
    try:
        _horovodrun()
    except BrokenPipeError:
        _reader_gone()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _reader_gone()


def _reader_gone() -> None:
    """The reader of stdout left, nothing failed: what is still buffered goes nowhere, and the status is 1."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush goes nowhere
    sys.exit(1)


def _horovodrun() -> None:
    forwarding.take_signals()  # first: Horovod's runner takes a second to load, a signal may come meanwhile
    forwarding.tracker_outlives_a_hang_up()

    from horovod.runner import gloo_run, launch, mpi_run

    from hvdtrain.cli.build_answers import remember_answers

    remember_answers(launch)  # 3 s of a core per launch otherwise
    mpi_run.os = MpirunAsChild()  # keeps this process, and its handlers, in front of mpirun
    # Horovod's Gloo launcher would take SIGINT and SIGTERM over and kill every rank 5 s later,
    # stopped or not: its shutdown event is left unset, the ranks stop themselves.
    gloo_run.register_shutdown_event = threading.Event
    elastic_launch.prepare(launch, gloo_run)
    launch.parse_args = checked(launch.parse_args)
    workers = GlooWorkers(gloo_run)
    try:
        code = launch.run_commandline()
    except (ValueError, OSError) as err:  # the runner refusing its own arguments: -H, -np against the slots, a hostfile
        if forwarding.launch_has_begun() or isinstance(err, BrokenPipeError):
            raise
        refuse("horovodrun", said(err))
    except RuntimeError as err:
        message = " ".join(str(err).split())
        if "exited with non-zero status" not in message:
            if forwarding.launch_has_begun():
                raise
            refuse("horovodrun", message, 1)  # "could not connect to some hosts via ssh", after ssh's own words
        found = re.search(r"Process name: (\S+) Exit code: (-?\d+)", message)
        # Horovod names the first worker to exit; the one that failed first may have left later.
        failed = {rank: ended for rank, ended in workers.exits.items() if ended[0] != 0} or \
            ({found.group(1): (int(found.group(2)), 0.0)} if found else {})
        if not failed:
            print(f"horovodrun: {message}", file=sys.stderr, flush=True)
            sys.exit(1)
        code, line = outcome(failed)
        if code == ANOTHER_RANK_FAILED:  # no worker failed of itself: what its peers said may tell why
            workers.output.release()
        if line:
            print(f"horovodrun: {line}", file=sys.stderr, flush=True)
        sys.exit(code)
    workers.output.release()
    if workers.commands.ended_late:
        print(f"horovodrun: worker {', '.join(map(str, sorted(workers.commands.ended_late)))} had not ended "
              f"{STOPPED_GRACE_SECONDS:.0f} s after the others stopped, and was ended", file=sys.stderr, flush=True)
    sys.exit(STOPPED if workers.stopped else code)


def torchrun() -> None:
    forwarding.take_signals()  # first: torch takes a second to load; SIGUSR1/2 too, which torchrun leaves to their default
    nohup = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    if nohup:  # the agent, and the workers after it, keep ignoring it (a torch without the option: below)
        os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGQUIT")  # --signals-to-handle
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = sys.argv[1:]
    program = _program_index(argv)
    # torchrun's argparse also reads the program's own flags and stops at any that abbreviates two
    # of its options (`plan --np 2`: --nproc-per-node or --nproc_per_node?): it parses up to the
    # program only, and the program's arguments pass through untouched.
    args = parse_args(argv[:program + 1])
    args.training_script_args = argv[program + 1:]
    if args.training_script == "hvdtrain" and not (args.no_python or args.module or os.path.isfile("hvdtrain")):
        args.module = True  # python -m hvdtrain: the same program as the `hvdtrain` command
    check_torchrun_sizes(args)
    log_dir = _own_log_dir(args)
    _grace_after_a_failure(args)
    _no_restart_that_changes_nothing()
    # torchrun logs each failed worker at ERROR before it raises; the line below says it once.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)  # a signal's, said below
    # torchrun's own handler raises in the agent and then ends the workers; passed on instead, the
    # signal lets them stop together, and the agent reports their exit as for any other.
    from torch.distributed.elastic.multiprocessing import api

    api._terminate_process_handler = lambda number, frame: None if nohup and number == signal.SIGHUP else \
        forward_to_ranks(number, frame)
    forwarding.launch_begins(_raise_in_the_agent)
    code = 0
    try:
        try:
            run(args)
        finally:  # the agent has ended: a signal from here on has no agent to end (the process ends below)
            forwarding.launch_begins(None)
            _remove_if_empty(log_dir)
    except ChildFailedError as err:
        code, line = torchrun_outcome(err.failures)
        if line:
            print(f"torchrun: {line}", file=sys.stderr, flush=True)
    except api.SignalException as err:  # raised by _raise_in_the_agent; the agent ended what it had started
        code = 128 + err.sigval
        print(f"torchrun: stopped by {signal.Signals(err.sigval).name} while no worker was running",
              file=sys.stderr, flush=True)
    leave_without_teardown(code)  # once the failure's traceback, and the agent's frames, are let go
    sys.exit(code)


def _own_log_dir(args) -> str | None:
    """torchrun without --log-dir makes a temporary directory for its workers' logs and leaves it, a tree of
    empty directories in /tmp for every launch: one made here instead, removed after (`_remove_if_empty`)."""
    if args.log_dir:
        return None
    import tempfile

    args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    return args.log_dir


def _remove_if_empty(log_dir: str | None) -> None:
    """Removes the directory `_own_log_dir` made unless it holds a file (--redirects or --tee's logs)."""
    if log_dir and not any(files for _, _, files in os.walk(log_dir)):
        import shutil

        shutil.rmtree(log_dir, ignore_errors=True)


def _raise_in_the_agent(number: int) -> None:
    """A stop signal while the agent runs no worker (waiting for other nodes, say): torch's own handler's
    exception, on which the agent ends its rendezvous and whatever it started."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {number}", sigval=signal.Signals(number))


def _grace_after_a_failure(args) -> None:
    """Once a worker failed, the others cannot save anything together, and a rank stuck in user code
    (it notes SIGTERM for a next step that never comes) held the job for torchrun's 30 s: 5 s, as
    horovodrun gives its ranks, unless the user chose (--shutdown-timeout, TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
    torchrun's agent passes the chosen time when it is signalled and when it ends, but stops the
    group of a failed worker (in PContext._poll) with close()'s fixed 30 s: every close gets it here."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    chosen = getattr(args, "shutdown_timeout", None)  # torch < 2.10 has no such option
    if chosen is None:
        raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(FAILED_JOB_GRACE_SECONDS))
        chosen = int(raw) if raw.strip().isdigit() else -1
        if chosen < 0:
            print(f"torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT is whole seconds, not {raw!r}", file=sys.stderr)
            sys.exit(2)
    elif chosen < 0:
        print(f"torchrun: --shutdown-timeout is whole seconds, not {chosen}", file=sys.stderr)
        sys.exit(2)
    if hasattr(args, "shutdown_timeout"):
        args.shutdown_timeout = chosen
    close = PContext.close

    def close_within_grace(context: PContext, death_sig: signal.Signals | None = None, timeout: int = chosen) -> None:
        handlers = getattr(context, "subprocess_handlers", None) or {}
        running = [handler.proc for handler in handlers.values() if handler.proc.poll() is None]
        close(context, death_sig, chosen)
        # One that outlived the grace was killed here (SIGKILL): the agent's end, not a failure of its own.
        _KILLED_BY_THE_AGENT.update(proc.pid for proc in running if proc.returncode == -signal.SIGKILL)

    PContext.close = close_within_grace


def _no_restart_that_changes_nothing() -> None:
    """--max-restarts starts the workers again after any failure. Not after bad input (status 2: the
    same line again, as often as allowed) nor after a stop on a signal with a checkpoint (75: a scheduler
    or a user asked the job to end, and a restart would train on)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitored(agent: Any, worker_group: Any) -> Any:
        result = monitor(agent, worker_group)
        failures = getattr(result, "failures", None) or {}
        # The first to fail decides; the others were stopped by the agent after it (SIGTERM).
        first = min(failures.values(), key=lambda failure: failure.timestamp, default=None)
        if first is not None and first.exitcode in (UserError.exit_code, STOPPED):
            agent._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitored


def torchrun_outcome(failures: dict[int, object]) -> tuple[int, str | None]:
    """torchrun's exit status and its line, from its failed workers' records by rank (`outcome`); a worker
    the agent had to kill as it ended the others counts as ended by its SIGTERM."""
    return outcome({rank: (-signal.SIGTERM if failure.pid in _KILLED_BY_THE_AGENT else failure.exitcode,  # type: ignore[attr-defined]
                           failure.timestamp) for rank, failure in failures.items()}, "worker rank")  # type: ignore[attr-defined]


def _program_index(argv: list[str]) -> int:
    """Where the program (`hvdtrain`, a script) begins among torchrun's arguments."""
    from torch.distributed.run import get_args_parser

    options = {name: action.nargs != 0 for action in get_args_parser()._actions for name in action.option_strings}
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        name = argv[index].split("=", 1)[0]
        matches = [known for known in options if known.startswith(name)]  # argparse takes abbreviations
        takes_value = options.get(name, len(matches) == 1 and options[matches[0]])
        index += 2 if takes_value and "=" not in argv[index] else 1
    return min(index, max(0, len(argv) - 1))


if __name__ == "__main__":
    horovodrun()

"""Cluster files: the Dockerfiles and launch scripts lint clean, and the scripts really launch."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, ROOT, assert_ok, launch_env, requires_launchers, run_summary

SCRIPTS = sorted([*ROOT.glob("launch/*.sh"), ROOT / "launch" / "slurm.sbatch", ROOT / ".ci" / "run"])
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]


def test_dockerfiles_pass_hadolint():
    done = subprocess.run([str(BIN / "hadolint"), "--config", str(ROOT / "docker/.hadolint.yaml"), *map(str, DOCKERFILES)],
                          capture_output=True, text=True)
    assert_ok(done)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_shellcheck(script):
    # -x follows `source launch/require.sh`, whose path is relative to the repository root.
    done = subprocess.run([str(BIN / "shellcheck"), "-x", str(script)], capture_output=True, text=True, cwd=ROOT)
    assert_ok(done)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_through_the_shared_script(dockerfile):
    text = dockerfile.read_text()
    assert "bash launch/install.sh --venv /opt/venv" in text  # what make test (and so CI) runs
    assert "horovodrun --check-build" in text and "hvd.init()" in text


def test_mpijob_manifest_launches_hvdtrain():
    job = yaml.safe_load((ROOT / "launch/k8s/mpijob.yaml").read_text())
    assert job["kind"] == "MPIJob" and job["apiVersion"] == "kubeflow.org/v2beta1"
    replicas = job["spec"]["mpiReplicaSpecs"]
    command = replicas["Launcher"]["template"]["spec"]["containers"][0]["command"]
    pod_entry = ["python", "-m", "hvdtrain.cli.pod"]  # PID 1 passes the pod's SIGTERM on to the ranks
    assert command[:4] == [*pod_entry, "mpirun"] and command[command.index("hvdtrain") + 1] == "fit"
    assert command[command.index("--resume") + 1] == "auto"  # a restarted launcher goes on from the checkpoint
    slots = job["spec"]["slotsPerWorker"] * replicas["Worker"]["replicas"]
    assert command[command.index("-np") + 1] == str(slots)
    assert replicas["Worker"]["template"]["spec"]["containers"][0]["command"] == [*pod_entry, "/usr/sbin/sshd", "-De"]
    assert job["spec"]["runPolicy"]["backoffLimit"] > 0
    for role in ("Launcher", "Worker"):
        assert replicas[role]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


def test_mpijob_pod_templates_are_valid_kubernetes():
    """Each pod template against Kubernetes' own schema (strict: an unknown or misspelt field fails).
    The MPIJob's own fields are the CRD's, which no validator installed here carries."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    job = yaml.safe_load((ROOT / "launch/k8s/mpijob.yaml").read_text())
    assert set(job["spec"]) <= {"slotsPerWorker", "runPolicy", "mpiReplicaSpecs", "mpiImplementation",
                                "sshAuthMountPath", "launcherCreationPolicy", "runLauncherAsWorker"}
    for role, replica in job["spec"]["mpiReplicaSpecs"].items():
        assert role in ("Launcher", "Worker") and isinstance(replica["replicas"], int)
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                    "template": replica["template"]}
        kubernetes_validate.validate(template, kubernetes_validate.latest_version(), strict=True)


def test_hostfile_example_matches_horovodrun_format():
    lines = [line for line in (ROOT / "launch/hostfile.example").read_text().splitlines() if line and not line.startswith("#")]
    assert lines and all(len(line.split()) == 2 and line.split()[1].startswith("slots=") for line in lines)


def test_discovery_script_turns_a_hostfile_into_host_slots_lines(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\ngpu-node-1 slots=4\n\n  # gone for now\ngpu-node-2\n")
    done = subprocess.run(["bash", str(ROOT / "launch/discover-hosts.sh")], env={**launch_env(), "HOSTFILE": str(hostfile)},
                          capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["gpu-node-1:4", "gpu-node-2:1"]


@pytest.mark.parametrize("script", ["run-local.sh", "run-hosts.sh", "run-mpirun.sh"])
def test_launch_scripts_name_a_missing_launcher_in_one_line(script, tmp_path):
    # PATH without the virtual environment: no horovodrun, mpirun or hvdtrain.
    done = subprocess.run(["bash", str(ROOT / "launch" / script), "--run-dir", str(tmp_path / "r")],
                          env={**launch_env(), "PATH": "/usr/bin:/bin", "HOSTS": "localhost:2"},
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: '") and "is not on PATH: run 'make install'" in lines[0]
    assert lines[0].split("'")[1] in ("horovodrun", "mpirun", "hvdtrain")
    assert not (tmp_path / "r").exists()


def _launch(script: str, env_extra: dict, tmp_path: Path):
    env = {**launch_env(), **env_extra}
    done = subprocess.run(["bash", str(ROOT / "launch" / script), "--epochs", "1", "--progress", "off",
                           "--run-dir", str(tmp_path / "r")], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert_ok(done)
    return run_summary(tmp_path / "r")


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("script, env", [
    ("run-local.sh", {"NP": "2"}),
    ("run-hosts.sh", {"HOSTS": "localhost:2"}),
    ("run-mpirun.sh", {"NP": "2", "OVERSUBSCRIBE": "1"}),
])
def test_launch_scripts_pass_arguments_to_fit(script, env, tmp_path):
    summary = _launch(script, env, tmp_path)
    assert summary["world_size"] == 2 and summary["epochs"] == 1


def test_torchrun_s_outcome_names_the_killed_worker_and_keeps_a_clean_stop():
    """torchrun's status and line from its failed workers: a stop (75) on one rank is the job's even when
    the agent then killed a rank still on its way out; else a worker killed by a signal is named before
    the others, whose errors follow from it; else the first to fail."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from hvdtrain.cli.launchers import torchrun_outcome

    def failures(*codes: int) -> dict:
        made = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="/nonexistent")
                for rank, code in enumerate(codes)}
        for rank, failure in made.items():
            failure.timestamp = rank  # rank 0 failed first
        return made

    assert torchrun_outcome(failures(-15, 75)) == (75, None)
    assert torchrun_outcome(failures(75, 75)) == (75, None)
    assert torchrun_outcome(failures(1, -9)) == (137, "worker rank 1 was killed by SIGKILL (exit status 137); "
                                                      "the other workers were stopped")
    assert torchrun_outcome(failures(-15, -9))[1].startswith("worker rank 1 was killed by SIGKILL")  # the agent's SIGTERM
    assert torchrun_outcome(failures(-15, -15))[1].startswith("worker rank 0 was killed by SIGTERM")
    assert torchrun_outcome(failures(2, 1)) == (2, "worker rank 0 exited with status 2; the other workers were stopped")
    # Rank 0 said what was wrong and exited 2 while rank 1 waited for it: the agent's SIGTERM ended rank 1.
    assert torchrun_outcome(failures(2, -15)) == (2, "worker rank 0 exited with status 2; the other workers were stopped")
    # Rank 0's collective broke off (76) and it left first: rank 1, which failed, is named, with its status.
    assert torchrun_outcome(failures(76, 1)) == (1, "worker rank 1 exited with status 1; the other workers were stopped")
    assert torchrun_outcome(failures(76, -9))[0] == 137
    assert torchrun_outcome(failures(76, 76)) == (76, "worker rank 0 stopped because another rank failed or left "
                                                      "(exit status 76); the other workers were stopped")


def test_horovodrun_s_outcome_names_the_worker_that_failed_not_the_first_to_exit():
    """Horovod's Gloo launcher names the first worker to exit; a rank whose collective broke off (76) may
    leave before the rank that failed. Its workers' statuses come through `sh`: 128 + N for signal N."""
    from hvdtrain.cli.launchers import outcome

    assert outcome({0: (76, 1.0), 1: (1, 2.0)}) == (1, "worker 1 exited with status 1; the other workers were stopped")
    assert outcome({0: (76, 1.0), 1: (137, 2.0)}) == (137, "worker 1 was killed by SIGKILL (exit status 137); the "
                                                           "other workers were stopped")
    assert outcome({0: (143, 1.0), 1: (2, 2.0)})[1].startswith("worker 1 exited with status 2")  # SIGTERM: the launcher's
    assert outcome({0: (75, 1.0), 1: (143, 2.0)}) == (75, None)


def test_a_stop_the_launcher_passed_on_is_said_as_such_unless_a_worker_failed_of_itself(monkeypatch):
    """Workers of a program that does not stop with a checkpoint (predict, a script) end by the signal:
    that is the user's or the scheduler's stop, not worker 0's failure."""
    import signal

    from hvdtrain.cli import forwarding
    from hvdtrain.cli.launchers import outcome

    monkeypatch.setattr(forwarding, "_passed_on", [signal.SIGINT])
    stopped = (130, "stopped by SIGINT, which it passed on to the workers")
    assert outcome({0: (130, 1.0), 1: (-15, 2.0)}) == stopped  # the launcher's SIGTERM to the rest
    assert outcome({0: (-2, 1.0), 1: (-2, 1.0)}) == stopped
    assert outcome({0: (1, 1.0), 1: (130, 2.0)}) == (1, "worker 0 exited with status 1; the other workers were stopped")
    assert outcome({0: (75, 1.0), 1: (130, 2.0)}) == (75, None)
    assert outcome({0: (130, 1.0), 1: (76, 2.0)}) == stopped  # rank 1's collective broke off as rank 0 stopped
    monkeypatch.setattr(forwarding, "_passed_on", [signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM])
    assert outcome({0: (-15, 1.0), 1: (-15, 2.0)}) == (143, "stopped by SIGTERM, which it passed on to the workers")
    monkeypatch.setattr(forwarding, "_passed_on", [])
    assert outcome({0: (130, 1.0), 1: (143, 2.0)})[1].startswith("worker 0 was killed by SIGINT (exit status 130)")


@requires_launchers
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "torchrun"])
def test_a_script_stopped_through_the_launcher_is_a_stop_not_a_failure(launcher, tmp_path):
    from conftest import LAUNCHERS

    script = tmp_path / "wait.py"
    script.write_text("import os, pathlib, sys, time\n"
                      "rank = os.environ.get('HOROVOD_RANK', os.environ.get('RANK'))\n"
                      "pathlib.Path(sys.argv[1], f'started-{rank}').touch()\n"
                      "time.sleep(120)\n")
    prefix = LAUNCHERS[launcher] if launcher == "torchrun" else [*LAUNCHERS[launcher], sys.executable]
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    job = subprocess.Popen([*prefix, str(script), str(tmp_path)], env={**launch_env(), "TMPDIR": str(temporary)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    name = launcher.split("-")[0]
    assert job.returncode == 143, output[-3000:]
    assert f"{name}: stopped by SIGTERM, which it passed on to the workers" in output, output[-3000:]
    assert "worker 0" not in output and "worker rank 0" not in output, output[-3000:]
    assert not list(temporary.iterdir())  # torchrun left a tree of empty directories for its logs in each launch


@requires_launchers
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "torchrun"])
def test_a_worker_the_launcher_had_to_kill_after_another_failed_is_not_named_as_the_failure(launcher, tmp_path):
    """Rank 0 fails; rank 1 outlives the launcher's SIGTERM (on a loaded machine, still shutting its engine
    down) and is killed 5 s later. Horovod's launcher counted that SIGKILL as a failure before rank 0's."""
    from conftest import LAUNCHERS

    script = tmp_path / "fail.py"
    script.write_text("import os, pathlib, signal, sys, time\n"
                      "rank = os.environ.get('HOROVOD_RANK', os.environ.get('RANK'))\n"
                      "if rank == '0':\n"
                      "    while not pathlib.Path(sys.argv[1], 'deaf').exists():\n"
                      "        time.sleep(0.05)\n"
                      "    sys.exit(2)\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "pathlib.Path(sys.argv[1], 'deaf').touch()\n"
                      "time.sleep(60)\n")
    prefix = LAUNCHERS[launcher] if launcher == "torchrun" else [*LAUNCHERS[launcher], sys.executable]
    done = subprocess.run([*prefix, str(script), str(tmp_path)], env=launch_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    name = launcher.split("-")[0]
    worker = "worker rank" if name == "torchrun" else "worker"
    assert done.returncode == 2, done.stdout[-3000:]
    assert done.stdout.rstrip().splitlines()[-1] == f"{name}: {worker} 0 exited with status 2; the other workers " \
                                                    "were stopped", done.stdout[-3000:]
    assert "SIGKILL" not in done.stdout and done.stdout.count(f"{name}: ") == 1, done.stdout[-3000:]


@requires_launchers
def test_a_worker_killed_before_the_other_stopped_is_still_named_though_its_output_closes_later(tmp_path):
    """Rank 1 dies of SIGKILL (as of the out-of-memory killer) while a child of its own (a data-loader
    worker) holds its output open for 3 s more; rank 0 leaves with 76 as its peer went away. Horovod sees
    rank 0's exit first: rank 1's SIGKILL is still the failure, not an end the launcher gave it."""
    from conftest import LAUNCHERS

    script = tmp_path / "oom.py"
    script.write_text("import os, pathlib, signal, subprocess, sys, time\n"
                      "mark = pathlib.Path(sys.argv[1], 'killed')\n"
                      "if os.environ['HOROVOD_RANK'] == '0':\n"
                      "    while not mark.exists():\n"
                      "        time.sleep(0.05)\n"
                      "    time.sleep(0.5)\n"
                      "    sys.exit(76)\n"
                      "subprocess.Popen(['sleep', '3'])\n"
                      "mark.touch()\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([*LAUNCHERS["horovodrun-gloo"], sys.executable, str(script), str(tmp_path)],
                          env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert done.returncode == 137, done.stdout[-3000:]
    assert done.stdout.rstrip().splitlines()[-1] == "horovodrun: worker 1 was killed by SIGKILL (exit status 137); " \
                                                    "the other workers were stopped", done.stdout[-3000:]


@requires_launchers
def test_horovodrun_s_check_build_read_by_a_reader_that_leaves_at_once_is_no_traceback():
    """`horovodrun --check-build | head -1` (or `| true`): Horovod's print raised BrokenPipeError's traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before a word is written
    env = {name: value for name, value in launch_env().items() if name != "PYTHONUNBUFFERED"}  # a plain shell's:
    # the print waits in stdout's buffer, and fails only as the interpreter flushes it at the exit
    done = subprocess.run(["horovodrun", "--check-build"], env=env, stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    os.close(write)
    assert done.returncode == 1 and done.stderr == "", done.stderr


@requires_launchers
@pytest.mark.parametrize("arguments, said, code", [
    # a script's $NP unset: under --gloo nothing ran and the status was 0
    (["-np", "0", "--gloo"], "-np must be at least 1, got 0", 2),
    (["-np", "-1"], "-np must be at least 1, got -1", 2),
    (["-np", "3", "--gloo", "-H", "localhost:2"], "Requested more processes (3) than there are available slots (2): "
                                                  "ask fewer with -np, or give the hosts more slots", 2),
    (["-np", "2", "-H", "localhost:two"], "Invalid host input, please make sure it has format as", 2),
    (["-np", "2", "--gloo", "--hostfile", "no-such-hostfile"], "No such file or directory: no-such-hostfile", 2),
])
def test_horovodrun_s_refusal_of_its_own_arguments_is_one_line(arguments, said, code, tmp_path):
    """Horovod's runner refused these with a traceback (or, -np 0 under --gloo, ran nothing and exited 0)."""
    _refused_in_one_line(["horovodrun", *arguments], f"horovodrun: error: {said}", code, tmp_path)


@requires_launchers
@pytest.mark.parametrize("arguments, said", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0: give a number of processes per node (at least 1), or auto"),
    (["--nproc-per-node", "two"], "--nproc-per-node two: give a number of processes per node"),
    (["--nproc-per-node", "2", "--nnodes", "2:1"], "--nnodes 2:1: give a number of nodes (at least 1), or MIN:MAX"),
])
def test_torchrun_s_refusal_of_its_own_sizes_is_one_line(arguments, said, tmp_path):
    """torchrun refused these with a traceback of its own (`--nproc-per-node 0`: an AssertionError without a word)."""
    _refused_in_one_line(["torchrun", *arguments], f"torchrun: error: {said}", 2, tmp_path)


def _refused_in_one_line(launcher: list[str], said: str, code: int, tmp_path: Path) -> None:
    done = subprocess.run([*launcher, "hvdtrain", "fit", "--run-dir", str(tmp_path / "r")],
                          env=launch_env(), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == code and done.stdout == "", done
    assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "r").exists()


HOROVOD_MPIRUN = "mpirun --allow-run-as-root --tag-output -np 2 -H localhost:2 -bind-to none -map-by slot " \
                 "-mca pml ob1 -mca btl ^openib -mca btl_tcp_if_include lo hvdtrain fit"


@pytest.mark.parametrize("site, btl", [
    ("^uct,openib,ofi", "^openib,uct,ofi"),  # Debian's: kept, with Horovod's openib
    ("^ofi", "^openib,ofi"),
    ("self,vader,tcp", "^openib"),  # a list of transports to use: Horovod's flag stands, as before
    ("^ofi, uct", "^openib"),  # not Open MPI's form: nothing a shell could split is put on the line
    (None, "^openib"),  # nothing set
])
def test_horovodrun_s_mpirun_keeps_the_transports_open_mpi_s_settings_leave_out(site, btl, tmp_path):
    """Horovod's `-mca btl ^openib` on mpirun's command line overrode the site's own exclusions; on this host
    alone it is widened by them (ompi_info says what they are: a stand-in on PATH with its output format),
    and a job across hosts keeps Horovod's flag, each host's own settings being its own."""
    import socket

    from hvdtrain.cli.mpirun_child import with_site_transports

    info = tmp_path / "ompi_info"
    value = f"mca:btl:base:param:btl:value:{site}\n" if site is not None else ""
    info.write_text(f"#!/bin/sh\nprintf 'mca:btl:tcp:version:\"mca:2.1.0\"\\n{value}mca:btl:base:param:btl:level:2\\n'\n")
    info.chmod(0o755)
    env = {"PATH": str(tmp_path)}
    for hosts in ("localhost:2", f"{socket.gethostname()}:1,127.0.0.1:1"):
        command = HOROVOD_MPIRUN.replace("localhost:2", hosts)
        assert with_site_transports(command, env) == command.replace("-mca btl ^openib", f"-mca btl {btl}")
    across = HOROVOD_MPIRUN.replace("localhost:2", "localhost:1,node-2:1")
    assert with_site_transports(across, env) == across
    assert with_site_transports(HOROVOD_MPIRUN, {"PATH": str(tmp_path / "none")}) == HOROVOD_MPIRUN  # no ompi_info
    mine = HOROVOD_MPIRUN.replace("^openib", "^openib,mine")  # not Horovod's flag: left alone
    assert with_site_transports(mine, env) == mine


def test_a_peer_s_report_that_another_went_away_waits_for_the_failed_worker_s_own_end():
    """Horovod's background thread prints an error, with Horovod's and Gloo's build paths, on a rank
    whose peer was killed: held back, and said only where no worker failed of itself."""
    import io

    from hvdtrain.cli.gloo_workers import PeerGoneHeldBack

    stream = io.StringIO()
    output = PeerGoneHeldBack(stream)
    peer_gone = ("[0]<stderr>:[2026-01-01 00:00:00.000000: E /tmp/pip-wheel-x/horovod/common/operations.cc:697] "
                 "[0]: Horovod background loop uncaught exception: [/tmp/pip-wheel-x/third_party/gloo/gloo/"
                 "transport/tcp/pair.cc:589] Read error [127.0.0.1]:18870: Connection reset by peer\n")
    output.write("[0]<stderr>:hvdtrain: rank 0/2\n")
    output.write(peer_gone)
    assert stream.getvalue() == "[0]<stderr>:hvdtrain: rank 0/2\n"
    output.release()
    assert stream.getvalue() == "[0]<stderr>:hvdtrain: rank 0/2\n" + peer_gone


RULE = "-" * 74 + "\n"
ABORTED = RULE + "Primary job  terminated normally, but 1 process returned\na non-zero exit code. Per user-direction, " \
                 "the job has been aborted.\n" + RULE
EXITED = RULE + "mpirun detected that one or more processes exited with non-zero status, thus causing\nthe job to " \
                "be terminated. The first process to do so was:\n\n  Process name: [[29084,1],{rank}]\n  Exit code:    " \
                "{code}\n" + RULE
SIGNALLED = RULE + "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).\n" + RULE
SLOTS = RULE + "There are not enough slots available in the system to satisfy the 3\nslots that were requested.\n" + RULE


@pytest.mark.parametrize("mpirun_said, said", [
    (ABORTED + EXITED.format(rank=0, code=2), "horovodrun: worker 0 exited with status 2; the other workers were stopped\n"),
    (ABORTED + SIGNALLED, "horovodrun: worker 1 was killed by SIGKILL (exit status 137); the other workers were stopped\n"),
    (ABORTED + EXITED.format(rank=1, code=75), ""),  # a clean stop on a signal, with its checkpoint
    (SLOTS, SLOTS),  # Open MPI's other help texts say what to change
])
def test_horovodrun_says_open_mpi_s_report_of_a_failed_job_in_one_line(mpirun_said, said):
    """Open MPI boxed how the job ended in eleven lines, "aborted" after a stop with a checkpoint too. A
    rank's line inside a box, and a line in progress (a progress bar's), come out as they come."""
    import io

    from hvdtrain.cli.mpirun_report import MpirunReport

    read, write = os.pipe()
    out = io.StringIO()
    report = MpirunReport(os.fdopen(read, "rb"), out)
    os.write(write, b"[1,0]<stderr>:hvdtrain: rank 0/2\n[1,0]<stderr>:epoch 1: 50%\r")
    deadline = time.monotonic() + 10
    while "50%" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.getvalue() == "[1,0]<stderr>:hvdtrain: rank 0/2\n[1,0]<stderr>:epoch 1: 50%\r"
    box = mpirun_said.encode()
    inside = box.index(b"\n", len(RULE)) + 1  # after the box's first line of text
    os.write(write, box[:inside])
    os.write(write, b"[1,1]<stderr>:a rank's line\n" + box[inside:])
    os.close(write)
    report.finish()
    assert out.getvalue() == "[1,0]<stderr>:hvdtrain: rank 0/2\n[1,0]<stderr>:epoch 1: 50%\r[1,1]<stderr>:a rank's line\n" \
        + said


def test_horovodrun_s_one_line_survives_a_progress_bar_before_the_box_and_names_another_host():
    """A rank's bar, cleared with a carriage return and no newline, ends up on the line of the box's opening
    rule when both come in one read; a rank killed on another host is named with it."""
    import io

    from hvdtrain.cli.mpirun_report import MpirunReport

    read, write = os.pipe()
    out = io.StringIO()
    report = MpirunReport(os.fdopen(read, "rb"), out)
    bar = b"[1,0]<stderr>:epoch 1:  40%|####      | 4/10\r[1,0]<stderr>:\r"
    os.write(write, bar + (ABORTED + SIGNALLED.replace("node vm", "node gpu-host-7")).encode())
    os.close(write)
    report.finish()
    assert out.getvalue() == bar.decode() + ("horovodrun: worker 1 (on gpu-host-7) was killed by SIGKILL (exit status "
                                             "137); the other workers were stopped\n")


def test_mpirun_s_stderr_is_read_to_its_end_where_nothing_can_be_written():
    """Started with stderr closed (`2>&-`: sys.stderr is None), or a stream that fails: mpirun's pipe is still
    drained, or mpirun would block on it with the job."""
    from hvdtrain.cli.mpirun_report import MpirunReport

    class Failing:
        def write(self, text):
            raise RuntimeError("a stream that fails")

    import threading

    for out in (None, Failing()):
        read, write = os.pipe()
        report = MpirunReport(os.fdopen(read, "rb"), out)
        # past a pipe's 64 KiB: the writer (mpirun) blocks unless the pipe is read
        writer = threading.Thread(target=os.write, args=(write, (b"x" * 1000 + b"\n") * 400), daemon=True)
        writer.start()
        writer.join(10)
        assert not writer.is_alive()
        os.close(write)
        report.finish()
        assert not report.thread.is_alive()


def test_the_compiler_wrapper_builds_horovod_s_code_as_cxx17_with_the_headers_it_leaves_out(tmp_path):
    # Horovod pins -std=c++14 and uses std::string without <string>; torch's headers need C++17.
    source = tmp_path / "group_table.cc"
    source.write_text("static_assert(__cplusplus >= 201703L, \"C++17\");\n"
                      "std::string name() { return std::string(\"ok\") + std::to_string(uint8_t(1)); }\n")
    (tmp_path / "string").write_text("#error the build's own folder stood in for <string>\n")
    wrapper = str(ROOT / "launch" / "cxx17.sh")
    plain = {name: value for name, value in os.environ.items() if name != "HVDTRAIN_HOROVOD_DEBUG_INFO"}
    compiled = subprocess.run(["sh", wrapper, "-std=c++14", "-g", "-fPIC", "-c", source.name, "-o", "group_table.o"],
                              cwd=tmp_path, env=plain, capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stderr
    # RelWithDebInfo's -g is overridden (a faster build, a library a tenth the size) unless asked for.
    assert b".debug_info" not in (tmp_path / "group_table.o").read_bytes()
    debug = subprocess.run(["sh", wrapper, "-g", "-fPIC", "-c", source.name, "-o", "debug.o"], cwd=tmp_path,
                           env={**plain, "HVDTRAIN_HOROVOD_DEBUG_INFO": "1"}, capture_output=True, text=True,
                           timeout=120)
    assert debug.returncode == 0 and b".debug_info" in (tmp_path / "debug.o").read_bytes(), debug.stderr
    linked = subprocess.run(["sh", wrapper, "-shared", "group_table.o", "-o", "libgroup.so"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert linked.returncode == 0, linked.stderr


UNFIXED = ("  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
           "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;\n")


@pytest.mark.parametrize("source, fixed", [(UNFIXED, True), ("  auto dev = CreateDevice(attr);\n", False)],
                         ids=["0.28.1", "another-source"])
def test_horovod_s_source_gets_its_fix_or_the_build_stops(source, fixed, tmp_path):
    """The process set's Gloo context takes the global context's interface (launch/horovod-source.sh); a
    source whose code differs stops the build with one line instead of building unfixed."""
    import tarfile

    folder = tmp_path / "horovod-0.28.1" / "horovod" / "common" / "gloo"
    folder.mkdir(parents=True)
    (folder / "gloo_context.cc").write_text(f"void InitializeForProcessSet() {{\n{source}}}\n")
    with tarfile.open(tmp_path / "horovod-0.28.1.tar.gz", "w:gz") as sdist:
        sdist.add(tmp_path / "horovod-0.28.1", arcname="horovod-0.28.1")
    done = subprocess.run(["bash", str(ROOT / "launch" / "horovod-source.sh"), "python3", "", str(tmp_path / "out"),
                           str(tmp_path / "horovod-0.28.1.tar.gz")], capture_output=True, text=True)
    written = (tmp_path / "out" / "horovod-0.28.1" / "horovod" / "common" / "gloo" / "gloo_context.cc").read_text()
    if fixed:
        assert_ok(done)
        assert done.stdout.strip() == str(tmp_path / "out" / "horovod-0.28.1")
        assert written.count("gloo_iface_ = global_context.gloo_iface_;\n  attr device_attr;") == 1
    else:
        assert done.returncode != 0 and "is not the source this fix was written for" in done.stderr
        assert "global_context.gloo_iface_" not in written

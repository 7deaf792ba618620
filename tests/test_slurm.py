"""`sbatch launch/slurm.sbatch` on a real one-node Slurm cluster (munged, slurmctld, slurmd from
Debian), 2 tasks through `srun --mpi=pmix`; `scancel` ends every task and `--resume` finishes."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from conftest import ROOT, assert_ok, assert_same_weights, final_weights, launch_env, run_summary

why_not = slurm_cluster.available()
pytestmark = [pytest.mark.system, pytest.mark.multiprocess, pytest.mark.timeout(600),
              pytest.mark.skipif(why_not is not None, reason=why_not or "")]

# A one-node CPU cluster: 2 tasks of 1 core; the script's GPU directive is overridden with 0.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    with slurm_cluster.slurm_cluster(root / "cluster") as env:
        yield root, {**launch_env(), "SLURM_CONF": env["SLURM_CONF"], "PATH": f"/usr/sbin:{launch_env()['PATH']}"}


def _submit(env: dict, root: Path, *args: str, script: Path = ROOT / "launch" / "slurm.sbatch",
            options: tuple[str, ...] = ()) -> str:
    """sbatch `script` with `args` (after --progress off); `options` go to sbatch itself."""
    done = subprocess.run(["sbatch", "--parsable", *CPU_JOB, *options, f"--output={root}/job-%j.log", str(script),
                           "--progress", "off", *args], env=env, cwd=root, capture_output=True, text=True, timeout=30)
    assert_ok(done)
    return done.stdout.strip().split(";")[0]


def _state(env: dict, job: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=10)
    found = re.search(r"JobState=(\w+)", shown.stdout)
    return found.group(1) if found else "GONE"


# States a job passes through on its way to an end; SIGNALING shows while Slurm delivers --signal.
UNDER_WAY = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SIGNALING")


def _wait(env: dict, job: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(env, job)
        if state not in UNDER_WAY:
            return state
        time.sleep(0.5)
    # The one node is the next tests' too: the job ends here, and its log says where it was.
    shown = ""
    with contextlib.suppress(subprocess.SubprocessError):  # nothing here may hide the job's own failure
        shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                               timeout=10).stdout
        subprocess.run(["scancel", job], env=env, timeout=10)
    found = re.search(r"StdOut=(\S+)", shown)
    log = Path(found.group(1)) if found else None
    raise AssertionError(f"job {job} still {state} after {timeout} s (cancelled now); its log ends:\n"
                         f"{log.read_text()[-3000:] if log and log.exists() else '(none)'}")


def _start_again_once_requeued(env: dict, job: str, log: Path, timeout: float) -> None:
    """Waits until the job has requeued itself (its script said so, it is pending, its steps are gone),
    then lets it start at once."""
    deadline = time.monotonic() + timeout
    while not (log.exists() and "requeueing job" in log.read_text()) or _state(env, job) != "PENDING" or \
            subprocess.run(["pgrep", "-f", rf"slurmstepd: \[{job}\."]).returncode == 0:
        assert _state(env, job) in (*UNDER_WAY, "REQUEUED"), \
            f"job {job}: {_state(env, job)}; {log.read_text()[-3000:] if log.exists() else ''}"
        assert time.monotonic() < deadline, f"job {job} not requeued: {_state(env, job)}"
        time.sleep(0.2)
    _start_now(env, job)


def _assert_weights_of_a_run_never_stopped(env: dict, args: list[str], run_dir: Path, reference: Path) -> None:
    done = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "hvdtrain", "fit", "--progress", "off", *args,
                           "--threads", "1", "--run-dir", str(reference)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert_ok(done)
    assert_same_weights(final_weights(reference), final_weights(run_dir), atol=1e-6)


def _wait_through_requeues(env: dict, job: str, log: Path, timeout: float) -> str:
    """The job's end state, once requeued; a further requeue (Slurm signals each allocation, up to a
    minute before its limit) is let start at once too."""
    deadline, started = time.monotonic() + timeout, 1
    while (state := _state(env, job)) in (*UNDER_WAY, "REQUEUED"):
        requeues = log.read_text().count("requeueing job")
        if requeues > started and state == "PENDING" and \
                subprocess.run(["pgrep", "-f", rf"slurmstepd: \[{job}\."]).returncode != 0:
            _start_now(env, job)
            started = requeues
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
        time.sleep(0.5)
    return state


def _start_now(env: dict, job: str) -> None:
    """Lets a requeued job start at once instead of after Slurm's hold of about two minutes. Not within
    the second of the requeue: slurmd rejects a credential made in the second its job's old one was
    revoked ("Job credential revoked"), and the job would fail."""
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=10)


def _hvdtrain_processes(run_dir: Path) -> list[str]:
    """This job's hvdtrain processes (their command lines name its run directory)."""
    found = subprocess.run(["pgrep", "-af", "hvdtrain fit"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if str(run_dir) in line and "bin/python" in line]


def test_sbatch_runs_two_ranks_through_srun(cluster):
    root, env = cluster
    run_dir = root / "two-ranks"
    job = _submit(env, root, "--epochs", "2", "--run-dir", str(run_dir))
    assert _wait(env, job) == "COMPLETED", (root / f"job-{job}.log").read_text()[-3000:]
    log = (root / f"job-{job}.log").read_text()
    assert "hvdtrain: rank 0/2 local_rank 0/2" in log and "hvdtrain: rank 1/2 local_rank 1/2" in log
    assert log.count("epoch 2/2") == 1  # rank 0 alone prints
    summary = run_summary(run_dir)
    assert summary["world_size"] == 2 and summary["controller"] == "mpi" and summary["val_acc"] > 0.85


def test_sbatch_runs_the_torch_engine_through_srun(cluster):
    """--engine torch: rank and size from Slurm, the rendezvous at the MASTER_ADDR the script sets."""
    root, env = cluster
    run_dir = root / "torch-engine"
    job = _submit(env, root, "--epochs", "2", "--run-dir", str(run_dir), "--engine", "torch")
    assert _wait(env, job) == "COMPLETED", (root / f"job-{job}.log").read_text()[-3000:]
    log = (root / f"job-{job}.log").read_text()
    assert "hvdtrain: rank 0/2 local_rank 0/2" in log and "hvdtrain: rank 1/2 local_rank 1/2" in log
    summary = run_summary(run_dir)
    assert summary["world_size"] == 2 and summary["engine"] == "torch" and summary["controller"] == "gloo"


def test_plain_srun_without_an_mpi_plugin_is_one_run_of_two_tasks(cluster):
    """`srun -n 2 hvdtrain fit` as users type it in a batch script: no --mpi, so no MPI rank
    variables. The torch engine takes Slurm's own (one run of 2 tasks, not 2 runs of 1 in one
    directory); asking for the Horovod engine there is one line that says what to add."""
    root, env = cluster
    run_dir = root / "plain-srun"
    script = root / "plain-srun.sh"
    script.write_text('#!/bin/bash\n'
                      f'srun -n 2 hvdtrain fit --engine horovod --run-dir {root / "never"} "$@" || echo "refused: $?"\n'
                      f'srun -n 2 hvdtrain fit --epochs 2 --threads 1 --run-dir {run_dir} "$@"\n')
    job = _submit(env, root, script=script)
    log = (root / f"job-{job}.log").read_text() if _wait(env, job) == "COMPLETED" else ""
    assert "hvdtrain: rank 0/2 local_rank 0/2" in log and "hvdtrain: rank 1/2 local_rank 1/2" in log, \
        (root / f"job-{job}.log").read_text()[-3000:]
    assert log.count("epoch 2/2") == 1  # rank 0 alone prints
    summary = run_summary(run_dir)
    assert summary["world_size"] == 2 and summary["engine"] == "torch" and summary["controller"] == "gloo"
    errors = [line for line in log.splitlines() if "hvdtrain: error:" in line]
    assert len(errors) == 1 and "srun started 2 tasks without an MPI plugin" in errors[0], log[-3000:]
    assert "refused: 2" in log and "Traceback" not in log and not (root / "never").exists()


def test_a_port_in_use_under_plain_srun_ends_every_task_with_rank_0_s_line(cluster):
    """MASTER_PORT held by another process on rank 0's node: rank 0 cannot host the rendezvous and says
    so. srun alone does not end the other task, which would wait for rank 0 until the rendezvous
    timeout (6 minutes, the job held all along): rank 0 ends its step, and the job ends in seconds."""
    root, env = cluster
    run_dir = root / "port-taken"
    with socket.socket() as taken:  # listening, never answering: a rank 1 that reached it would hang
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        script = root / "port-taken.sh"
        script.write_text("#!/bin/bash\nexport MASTER_ADDR=127.0.0.1 MASTER_PORT="
                          f"{taken.getsockname()[1]}\nsrun -n 2 hvdtrain fit --engine torch --run-dir {run_dir} "
                          '"$@"; echo "srun exited $?"\n')
        job = _submit(env, root, script=script)
        state = _wait(env, job, timeout=90)
    log = (root / f"job-{job}.log").read_text()
    errors = [line for line in log.splitlines() if "hvdtrain: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("hvdtrain: error: rank 0: the ranks could not meet") and \
        "port may be in use" in errors[0], log[-3000:]
    assert state == "COMPLETED" and "srun exited 0" not in log and "Traceback" not in log, log[-3000:]
    assert not (run_dir / "checkpoints").exists()


def test_the_torch_engine_across_nodes_meets_on_the_step_s_first_node(cluster):
    """Without MASTER_ADDR, srun's tasks on several nodes meet on the first node of the step's
    compressed node list, as Slurm's own scontrol expands it."""
    _, env = cluster
    env = {key: value for key, value in env.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_STEP_NODELIST="node[07-09],gpu1", SLURM_JOB_ID="41")
    done = subprocess.run([sys.executable, "-c", "import os; from hvdtrain.engine.rendezvous import "
                           "init_method; print(init_method(one_host=False), os.environ['MASTER_ADDR'], "
                           "os.environ['MASTER_PORT'])"], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["env://", "node07", str(29500 + 41)], done.stderr[-2000:]


def test_two_steps_of_one_job_at_once_on_one_node_each_train_with_the_torch_engine(cluster):
    """Two `srun` steps started together in one allocation, on one node, with no MASTER_PORT: each
    step's ranks meet at a port of their own and both runs finish."""
    root, env = cluster
    fit = (f"hvdtrain fit --engine torch --progress off --data random --set data.samples=512 --epochs 1 "
           f"--threads 1 --run-dir {root}/step")
    script = root / "two-steps.sh"
    script.write_text("#!/bin/bash\nunset MASTER_ADDR MASTER_PORT\n"
                      f"srun --overlap -n 2 {fit}-a & first=$!\n"
                      f"srun --overlap -n 2 {fit}-b & second=$!\n"
                      "wait $first; a=$?; wait $second; b=$?\necho \"steps exited $a $b\"\nexit $((a | b))\n")
    job = _submit(env, root, script=script)
    state = _wait(env, job, timeout=180)
    log = (root / f"job-{job}.log").read_text()
    assert state == "COMPLETED" and "steps exited 0 0" in log, log[-3000:]
    for step in ("a", "b"):
        assert run_summary(root / f"step-{step}")["world_size"] == 2


def test_scancel_ends_every_task_and_resume_finishes(cluster):
    root, env = cluster
    run_dir = root / "cancelled"
    # Paced (about 2 s an epoch, in sleeps): still training when scancel comes, however loaded the host.
    args = ["--data", "random", "--set", "data.samples=6000", "--set", "data.features=12", "--epochs", "6",
            "--model", "user_code:paced_mlp", "--run-dir", str(run_dir)]
    job = _submit(env, root, *args)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _state(env, job) == "RUNNING" and len(_hvdtrain_processes(run_dir)) == 2, "the job should be mid-training"
    subprocess.run(["scancel", job], env=env, check=True, timeout=10)
    cancelled = time.monotonic()
    assert _wait(env, job, timeout=30) == "CANCELLED"
    while _hvdtrain_processes(run_dir) and time.monotonic() - cancelled < 15:
        time.sleep(0.2)
    assert _hvdtrain_processes(run_dir) == [], "scancel left tasks running"
    assert not (run_dir / "summary.json").exists()

    again = _submit(env, root, *args, "--resume")
    assert _wait(env, again) == "COMPLETED", (root / f"job-{again}.log").read_text()[-3000:]
    log = (root / f"job-{again}.log").read_text()
    assert "resuming from" in log and "epoch 6/6" in log
    summary = run_summary(run_dir)
    assert summary["world_size"] == 2 and summary["epochs"] == 6 and summary["resumed_from_epoch"] >= 1


def test_a_signal_to_the_tasks_requeues_the_job_which_resumes_and_finishes_exactly(cluster, tmp_path):
    """What Slurm's --signal before the time limit does, at once: scancel --signal=TERM reaches every task,
    they stop at one step with a checkpoint (exit 75), the script requeues the job, and the job goes on
    from that checkpoint to the end, with the weights of a run never stopped."""
    root, env = cluster
    run_dir = root / "requeued"
    # Paced in the first allocation (a sleep, not work: the other tests keep the cores), full speed after.
    args = ["--data", "random", "--set", "data.samples=2000", "--set", "data.features=12", "--epochs", "3",
            "--model", "user_code:paced_in_first_allocation"]
    job = _submit(env, root, *args, "--run-dir", str(run_dir))
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "epoch-0001.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True, timeout=10)
    log = root / f"job-{job}.log"
    # Slurm holds a requeued job for about two minutes before it may start again (not what is tested).
    _start_again_once_requeued(env, job, log, timeout=60)
    assert _wait(env, job, timeout=300) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    # Inside epoch 2 as a rule; at the end of epoch 1 when it came during that epoch's checkpoint.
    assert len(re.findall(r"hvdtrain: stopped by SIGTERM at (the end of )?epoch", text)) == 1, text[-3000:]
    assert f"requeueing job {job} (restart 1)" in text
    assert re.search(r"resuming from \S+epoch-000\d(-sample-\d+)?\.pt", text), text[-3000:]
    _assert_weights_of_a_run_never_stopped(env, args, run_dir, tmp_path / "reference")


def test_slurm_s_signal_before_the_time_limit_stops_the_job_which_requeues_and_finishes_exactly(cluster, tmp_path):
    """Slurm's own clock: a two-minute limit with SIGUSR1 60 s before it (`--time=2 --signal=USR1@60`,
    the script's lines with shorter times). The tasks, slowed in the first allocation only, are still
    training when Slurm signals them: they stop with a checkpoint, the job requeues itself instead of
    timing out, and a later allocation finishes with the weights of a run never stopped. Slurm sends
    the signal at its next periodic check once it is due, up to 30 s early here (a minute by its own
    account): 30 to 60 s in, past the tasks' start. (A busy machine's later allocation can still be
    signalled: it stops and requeues the same way, once more.)"""
    root, env = cluster
    run_dir = root / "time-limited"
    args = ["--data", "random", "--set", "data.samples=2000", "--set", "data.features=12", "--epochs", "10",
            "--model", "user_code:paced_in_first_allocation"]
    job = _submit(env, root, *args, "--run-dir", str(run_dir), options=("--time=2", "--signal=USR1@60"))
    log = root / f"job-{job}.log"
    _start_again_once_requeued(env, job, log, timeout=150)
    assert _wait_through_requeues(env, job, log, timeout=300) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    stops = re.findall(r"hvdtrain: stopped by SIGUSR1 at (?:the end of )?epoch \d+", text)
    restarts = re.findall(rf"requeueing job {job} \(restart (\d+)\)", text)
    # Every signalled allocation stopped once with a checkpoint and requeued; the first one always was.
    assert stops and [int(n) for n in restarts] == list(range(1, len(stops) + 1)), text[-3000:]
    assert "Traceback" not in text and "DUE TO TIME LIMIT" not in text, text[-3000:]
    _assert_weights_of_a_run_never_stopped(env, args, run_dir, tmp_path / "reference")

"""Stopping on a signal at one optimizer step on every rank, checkpoints inside an epoch, and an
exact resume from them, for real under horovodrun, mpirun and torchrun on the CPU.

The model (tests/user_code.py `signals_itself`) sends a signal to its own process in a chosen
training forward pass on a chosen rank, so the moment is known, not guessed from the clock.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (HOROVOD_AND_TORCH, LAUNCHERS, assert_ok, assert_same_weights, epoch_records, final_weights,
                      fit_under, free_port, launch_env, requires_launchers, run, run_summary, step_losses)

pytestmark = [pytest.mark.multiprocess, requires_launchers, pytest.mark.timeout(300)]

# 1600 training samples, a global batch of 2 x 64: 12 steps per epoch. Dropout, so that a resume
# is exact only if every rank's random state is restored too. The step log's windows of 7 steps span
# checkpoints, inside epochs and at their ends.
ARGS = ["--data", "random", "--set", "data.samples=2000", "--set", "data.features=12", "--epochs", "3",
        "--threads", "1", "--model", "user_code:signals_itself", "--progress", "off", "--log-every", "7",
        "--set", "run.stop_check_seconds=0"]  # check after every step: the stop step is the signal's
STEPS_PER_EPOCH = 12


def fit(launcher: str | None, run_dir: Path, *args: str, signal_at: str | None = None,
        dropout: str | None = None, overflow_at: str | None = None,
        at_exit: str | None = None, record: Path | None = None, tmpdir: Path | None = None,
        ) -> subprocess.CompletedProcess:
    """`hvdtrain fit` under the launcher; `signal_at` is HVDTRAIN_TEST_SIGNAL (RANK:N:SIGNAL),
    `overflow_at` HVDTRAIN_TEST_OVERFLOW, `at_exit` HVDTRAIN_TEST_EXIT_SIGNAL, `record`
    HVDTRAIN_TEST_RECORD (see tests/user_code.py), `tmpdir` TMPDIR."""
    env = {"HVDTRAIN_TEST_SIGNAL": signal_at or "", "HVDTRAIN_TEST_DROPOUT": dropout or "0.2",
           "HVDTRAIN_TEST_OVERFLOW": overflow_at or "", "HVDTRAIN_TEST_EXIT_SIGNAL": at_exit or "",
           "HVDTRAIN_TEST_RECORD": str(record or ""), **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return fit_under(launcher, *ARGS, *args, "--run-dir", str(run_dir), env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = fit("horovodrun-gloo", run_dir)
    assert_ok(done)
    return run_dir


def same_records(a: Path, b: Path) -> None:
    """The same epochs with the same losses and metrics (timings aside), and the same step log in
    TensorBoard: a window of steps that spans the checkpoint is logged over all its steps."""
    keys = ("epoch", "step", "train_loss", "val_loss", "val_acc", "train_samples", "val_samples", "lr")
    for mine, theirs in zip(epoch_records(a), epoch_records(b), strict=True):
        assert {k: mine[k] for k in keys} == pytest.approx({k: theirs[k] for k in keys}, rel=1e-6)
    assert step_losses(a) == pytest.approx(step_losses(b), rel=1e-6)


@pytest.mark.parametrize("launcher", HOROVOD_AND_TORCH)  # mpirun: below, with SIGUSR1 and 4 processes
def test_sigterm_to_one_rank_stops_every_rank_at_one_step_and_the_resume_is_exact(launcher, uninterrupted,
                                                                                    tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    stopped = fit(launcher, run_dir, signal_at=f"1:{STEPS_PER_EPOCH + 8}:SIGTERM")  # epoch 2, step 8 of 12
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 75, output[-3000:]
    assert time.monotonic() - started < 60
    assert output.count("hvdtrain: stopped by SIGTERM at epoch 2, step 20: checkpoint written; "
                        "continue with --resume") == 1, output[-3000:]
    assert "Traceback" not in output and "hvdtrain: error" not in output, output[-3000:]
    # The checkpoint holds 8 steps of epoch 2 (8 x 128 samples); the run's epoch 1 record only.
    assert (run_dir / "checkpoints" / "epoch-0002-sample-000001024.pt").is_file()
    assert [r["epoch"] for r in epoch_records(run_dir)] == [1]

    # The resumed run gets SIGUSR1 as its ranks exit, after fit (Slurm's --signal can come while a finished
    # job shuts down): nothing is left to stop, and it ends well. (The torch engine's ranks leave before the
    # interpreter's exit.)
    resumed = fit(launcher, run_dir, "--resume", at_exit="SIGUSR1")
    assert_ok(resumed)
    assert "(epoch 1, step 20, 1024 samples into epoch 2)" in resumed.stdout
    assert_same_weights(final_weights(uninterrupted), final_weights(run_dir), atol=1e-6)
    same_records(uninterrupted, run_dir)


def test_a_signal_while_fit_sets_up_stops_at_the_first_step_with_a_checkpoint(tmp_path):
    """SIGUSR1 (SIGTERM likewise) while the data set is built, before training: noted, not a death
    by the signal's default action; every rank stops at step 1 with a checkpoint and exits 75."""
    launcher = "torchrun"
    run_dir = tmp_path / "run"
    args = ["--data", "user_code:signals_while_loading", "--epochs", "2", "--threads", "1", "--progress", "off",
            "--set", "run.stop_check_seconds=0", "--batch-size", "16"]
    os.environ["HVDTRAIN_TEST_SETUP_SIGNAL"] = "SIGUSR1"
    try:
        stopped = run([*LAUNCHERS[launcher], "hvdtrain", "fit", *args, "--run-dir", str(run_dir)])
    finally:
        os.environ.pop("HVDTRAIN_TEST_SETUP_SIGNAL")
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 75, output[-3000:]
    assert output.count("hvdtrain: stopped by SIGUSR1 at epoch 1, step 1: checkpoint written") == 1, output[-3000:]
    assert (run_dir / "checkpoints" / "epoch-0001-sample-000000032.pt").is_file()
    resumed = run([*LAUNCHERS[launcher], "hvdtrain", "fit", *args, "--run-dir", str(run_dir), "--resume"])
    assert_ok(resumed)


@pytest.mark.parametrize("launcher", HOROVOD_AND_TORCH)
def test_a_signal_to_a_rank_still_importing_torch_stops_at_the_first_step(launcher, tmp_path):
    """Slurm's --signal can come seconds after the start. SIGUSR1 to rank 1 as soon as it catches the
    signal, before torch is even loaded in it: the rank notes it (it does not die of it), and every
    rank stops at step 1 with a checkpoint."""
    import psutil

    run_dir = tmp_path / "run"
    env = launch_env()  # and torch's import a second slower (tests/slow_torch_import): the moment is seen
    env["PYTHONPATH"] = f"{Path(__file__).parent / 'slow_torch_import'}{os.pathsep}{env['PYTHONPATH']}"
    job = subprocess.Popen([*LAUNCHERS[launcher], "hvdtrain", "fit", *ARGS, "--epochs", "2", "--run-dir",
                            str(run_dir)], env={**env, "HVDTRAIN_TEST_SIGNAL": ""}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    launched, deadline, rank = psutil.Process(job.pid), time.monotonic() + 60, None
    while rank is None and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.002)
        found = _ranks(launched).get(1)
        if found is None:
            continue
        try:
            loaded = "libtorch" in Path(f"/proc/{found.pid}/maps").read_text()  # read before the mask
        except OSError:
            continue
        if _catches(found.pid, signal.SIGUSR1):
            assert not loaded, "too late: rank 1 caught SIGUSR1 only once torch was loaded"
            rank = found
    assert rank is not None, "rank 1 never caught SIGUSR1"
    rank.send_signal(signal.SIGUSR1)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 75, output[-3000:]
    assert output.count("hvdtrain: stopped by SIGUSR1 at epoch 1, step 1: checkpoint written") == 1, output[-3000:]


@pytest.mark.parametrize("launcher", HOROVOD_AND_TORCH)
def test_a_signal_to_the_launcher_before_any_rank_started_stops_them_at_the_first_step(launcher, tmp_path):
    """Slurm's warning to a launcher that has no rank yet (it is still loading, or probing for MPI): it
    waits until the ranks hold it, then passes it on, and they stop at step 1 with a checkpoint. It
    killed torchrun, and under horovodrun reached only Horovod's `mpirun --version` probe ("horovod
    does not find an installed MPI") or nothing at all."""
    import psutil

    run_dir = tmp_path / "run"
    job = subprocess.Popen([*LAUNCHERS[launcher], "hvdtrain", "fit", *ARGS, "--epochs", "1", "--run-dir",
                            str(run_dir)], env={**launch_env(), "HVDTRAIN_TEST_SIGNAL": ""},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not _catches(job.pid, signal.SIGUSR1) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.002)
    assert not _ranks(psutil.Process(job.pid)), "too late: a rank had started"
    job.send_signal(signal.SIGUSR1)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 75, output[-3000:]
    assert output.count("hvdtrain: stopped by SIGUSR1 at epoch 1, step 1: checkpoint written") == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_stop_while_torchrun_waits_for_other_nodes_ends_it_at_once(tmp_path):
    """torchrun for two nodes, started on one: its agent waits in the rendezvous, with no worker to pass a stop
    to. Ctrl-C was swallowed there (and a SIGTERM just before the workers started was lost: the job trained
    on); now the agent ends as torch's own handler ends it, in one line."""
    import socket

    port = free_port()
    job = subprocess.Popen([*LAUNCHERS["torchrun"][:1], "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--no-python", "hvdtrain", "fit", *ARGS,
                            "--run-dir", str(tmp_path / "run")], env=launch_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.poll() is None:  # until the agent hosts the rendezvous
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    time.sleep(1)  # and waits in it
    job.send_signal(signal.SIGINT)
    output, _ = job.communicate(timeout=30)
    assert job.returncode == 130, output[-3000:]
    assert "torchrun: stopped by SIGINT while no worker was running" in output, output[-3000:]
    assert "Traceback" not in output and not (tmp_path / "run").exists(), output[-3000:]


def test_a_stop_during_horovodrun_s_probe_for_mpi_ends_it_and_nothing_trains(tmp_path):
    """A SIGTERM while horovodrun runs `mpirun --version` (before the job's own mpirun) reached the probe alone:
    Horovod said MPI was not installed, or the job started and trained on. Now the launcher ends as the
    signal's default would."""
    import psutil

    # The probe lasts milliseconds, which a loaded host's polling missed: a stand-in mpirun first on PATH
    # makes it last 3 s (and runs the real one for the probe and for the job alike).
    env = launch_env()
    real = shutil.which("mpirun", path=env["PATH"])
    stand_in = tmp_path / "bin" / "mpirun"
    stand_in.parent.mkdir()
    stand_in.write_text(f'#!/bin/sh\ncase "$*" in *--version*) sleep 3;; esac\nexec {real} "$@"\n')
    stand_in.chmod(0o755)
    env["PATH"] = f"{stand_in.parent}{os.pathsep}{env['PATH']}"
    job = subprocess.Popen([*LAUNCHERS["horovodrun-mpi"], "hvdtrain", "fit", *ARGS, "--run-dir",
                            str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    launcher, deadline, probing = psutil.Process(job.pid), time.monotonic() + 60, False
    while not probing and time.monotonic() < deadline and job.poll() is None:
        try:
            probing = any("--version" in child.cmdline() for child in launcher.children(recursive=True))
        except psutil.Error:  # a child gone meanwhile
            pass
        time.sleep(0.002)
    assert probing, "the probe was not seen"
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=60)
    assert job.returncode == -signal.SIGTERM, output[-3000:]
    assert "does not find an installed MPI" not in output and not (tmp_path / "run").exists(), output[-3000:]


def _catches(pid: int, number: int) -> bool:
    """Whether the process has a handler for the signal (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask & (1 << (number - 1)))


def test_a_signal_during_evaluation_stops_every_rank_at_that_epoch_s_end(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    stopped = fit("torchrun", run_dir, signal_at="1:v6:SIGTERM")  # 4 evaluation batches a rank: epoch 2's
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 75, output[-3000:]
    assert output.count("hvdtrain: stopped by SIGTERM at the end of epoch 2, step 24: checkpoint written") == 1, \
        output[-3000:]
    assert [r["epoch"] for r in epoch_records(run_dir)] == [1, 2]  # epoch 2 finished, none of epoch 3 begun
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 2
    resumed = fit("torchrun", run_dir, "--resume")
    assert_ok(resumed)
    assert_same_weights(final_weights(uninterrupted), final_weights(run_dir), atol=1e-6)
    same_records(uninterrupted, run_dir)


@pytest.mark.parametrize("launcher", ["horovodrun-mpi", "torchrun"])  # Horovod's stall inspector; hvdtrain's watchdog
def test_a_checkpoint_write_slower_than_the_stall_timeout_is_no_stall_and_a_signal_during_it_loses_nothing(
        launcher, uninterrupted, tmp_path):
    """Rank 0's first checkpoint write takes 12 s with train.stall_timeout 5: the others wait for it in
    short checks, not one long collective, so nothing takes the job for stalled. SIGTERM to the launcher
    in the middle of that write: the write completes, every rank stops at that epoch's end, and the
    resume ends with the uninterrupted run's weights."""
    run_dir, mark = tmp_path / "run", tmp_path / "saving"
    env = {**launch_env(), "HVDTRAIN_TEST_SIGNAL": "", "HVDTRAIN_TEST_DROPOUT": "0.2",
           "HVDTRAIN_TEST_SLOW_SAVE": f"12:{mark}"}
    job = subprocess.Popen([*LAUNCHERS[launcher], "hvdtrain", "fit", *ARGS, "--set", "train.stall_timeout=5",
                            "--run-dir", str(run_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    deadline = time.monotonic() + 60
    while not mark.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mark.exists(), job.communicate()[0][-3000:]
    time.sleep(7)  # past the stall timeout, inside the write
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 75, output[-3000:]
    assert "stall" not in output and "Traceback" not in output, output[-3000:]
    assert output.count("hvdtrain: stopped by SIGTERM at the end of epoch 1, step 12: checkpoint written") == 1, \
        output[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").glob("epoch-*.pt")] == ["epoch-0001.pt"]
    resumed = fit(launcher, run_dir, "--resume")
    assert_ok(resumed)
    assert_same_weights(final_weights(uninterrupted), final_weights(run_dir), atol=1e-6)


def test_fp16_accumulation_and_augmenting_data_loader_workers_resume_exactly_from_a_signal_inside_an_epoch(tmp_path):
    """The gradient scaler (each rank's, broadcast from rank 0 on resume) and the accumulation window:
    rank 1's gradients overflow once in epoch 1, so every scaler halves to 2^15; the stop comes at an
    optimizer step of epoch 3, between windows, and the resume is exact. (With only rank 0's scaler
    restored, rank 1 went on at 2^16 and the ranks' updates differed.) The data come through two
    data-loader workers per rank, each drawing a random augmentation (torch, numpy, random) in
    __getitem__, and the SIGTERM goes to rank 0 and its workers (as Slurm signals every process of a
    step): the workers leave the signal to their rank, their random state is the batch's own, and the
    batches they had read ahead are drawn again alike after the resume."""
    extra = ["--precision", "fp16", "--accumulate", "2", "--data", "user_code:augmented", "--set", "data.num_workers=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert_ok(fit("horovodrun-gloo", whole, *extra, overflow_at="5"))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    stopped = fit("horovodrun-gloo", cut, *extra, signal_at="0:30:SIGTERM:workers", overflow_at="5",
                  tmpdir=temporary)  # step 15
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    # The workers killed at the stop left their temporary directories behind (pymp-*, one each).
    assert not [p.name for p in temporary.iterdir() if p.name.startswith("pymp-")]
    assert "stopped by SIGTERM at epoch 3, step 15" in stopped.stdout + stopped.stderr
    resumed = fit("horovodrun-gloo", cut, *extra, "--resume")
    assert_ok(resumed)
    assert "(epoch 2, step 15, 768 samples into epoch 3)" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_weights(final_weights(whole), final_weights(cut), atol=1e-6)
    scalers = [torch.load(d / "checkpoints" / "last.pt", weights_only=True)["scaler"] for d in (whole, cut)]
    assert scalers[0] == scalers[1] and scalers[0]["scale"] == 2.0 ** 15  # one overflow, no growth since
    same_records(whole, cut)


def test_checkpoints_every_n_steps_resume_on_fewer_and_more_processes_each_sample_once(tmp_path):
    """Stopped at step 7 of 12 of epoch 2 on 2 processes; resumed on 1 and on 4 with the same global batch:
    the rest of the epoch is shared by the new ranks, each of epoch 2's 12 global batches (its order's
    first 1536 positions) trained on exactly once, before the stop or after it; the learning rate is
    the one for the run's global batch (scaled, and stopped inside a 2-epoch warm-up), so the weights
    are the uninterrupted 2-process run's (up to the order of the sums)."""
    from hvdtrain.data.sampler import FeistelPermutation

    same_lr = ["--warmup-epochs", "2", "--data", "user_code:indexed", "--model", "user_code:records_indices"]
    whole = tmp_path / "whole"
    assert_ok(fit("horovodrun-gloo", whole, *same_lr, dropout="0"))
    stopped, before = tmp_path / "stopped", tmp_path / "before"
    before.mkdir()
    done = fit("horovodrun-gloo", stopped, *same_lr, "--checkpoint-every-steps", "5",
               signal_at=f"0:{STEPS_PER_EPOCH + 7}:SIGUSR1", dropout="0", record=before)
    assert done.returncode == 75, done.stderr[-3000:]
    names = sorted(p.name for p in (stopped / "checkpoints").glob("epoch-*.pt"))
    # Every 5 steps (5, 10), epoch 1's end (12), 15 and the stop at 19; the last three are kept (and the
    # best, epoch 1's, the only one with validation metrics, is among them).
    assert names == ["epoch-0001.pt", "epoch-0002-sample-000000384.pt", "epoch-0002-sample-000000896.pt"], names
    # Each rank's record: epoch 1's 12 steps of 64, then epoch 2's 7 before the stop.
    epoch_2_before = [int(n) for path in before.glob("*.txt") for n in path.read_text().split()[12 * 64:]]
    assert len(epoch_2_before) == 2 * 7 * 64
    expected = sorted(FeistelPermutation(1600, 0, 2)(np.arange(12 * 128)).tolist())
    for np_, batch in ((1, 128), (4, 32)):
        copy, after = tmp_path / f"np{np_}", tmp_path / f"after-np{np_}"
        shutil.copytree(stopped, copy)
        after.mkdir()
        prefix = [] if np_ == 1 else ["mpirun", "-np", "4", "--oversubscribe", "-x", "HVDTRAIN_TEST_DROPOUT", "-x",
                                      "HVDTRAIN_TEST_RECORD"]
        resumed = run([*prefix, "hvdtrain", "fit", *ARGS, *same_lr, "--batch-size", str(batch), "--run-dir",
                       str(copy), "--resume"], env={"HVDTRAIN_TEST_DROPOUT": "0", "HVDTRAIN_TEST_RECORD": str(after)},
                      timeout=240)
        assert_ok(resumed)
        assert "896 samples into epoch 2" in resumed.stdout and "warning" not in resumed.stdout
        # Each new rank's record: the 5 steps left of epoch 2, then epoch 3's 12.
        records = [path.read_text().split() for path in after.glob("*.txt")]
        assert len(records) == np_ and all(len(numbers) == 17 * batch for numbers in records)
        epoch_2_after = [int(n) for numbers in records for n in numbers[:5 * batch]]
        assert sorted(epoch_2_before + epoch_2_after) == expected
        assert_same_weights(final_weights(whole), final_weights(copy), atol=1e-5)
        assert [r["world_size"] for r in epoch_records(copy)] == [2, np_, np_]
        assert step_losses(copy) == pytest.approx(step_losses(whole), rel=1e-5)  # steps 15-21 span the stop
        assert [r["lr"] for r in epoch_records(copy)] == \
            pytest.approx([r["lr"] for r in epoch_records(whole)], rel=1e-12)
        assert torch.load(copy / "checkpoints" / "last.pt", weights_only=True)["lr_batch"] == 64
    # The data set changed meanwhile (images added to a folder, say): the rest of the epoch cannot follow
    # the order the stop left it in, and the resume says so.
    shutil.copytree(stopped, tmp_path / "changed")
    resumed = run(["hvdtrain", "fit", *ARGS, *same_lr, "--run-dir", str(tmp_path / "changed"), "--resume"],
                  env={"HVDTRAIN_TEST_DROPOUT": "0", "HVDTRAIN_TEST_TRAIN_SAMPLES": "1500"}, timeout=240)
    assert_ok(resumed)
    assert ("hvdtrain: warning: the training set has 1500 samples, 1600 when this checkpoint was written: the rest "
            "of epoch 2 follows the new set's order") in resumed.stdout, resumed.stdout[-3000:]


@pytest.fixture(scope="module")
def ten_epochs(tmp_path_factory) -> Path:
    """A run long enough to be signalled in the middle of training, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("ten-epochs") / "run"
    assert_ok(fit("horovodrun-gloo", run_dir, "--epochs", "10"))
    return run_dir


# Each launcher as a scheduler or a user reaches it: SIGTERM (Slurm's time limit, Kubernetes' eviction,
# kill, Ctrl-C's SIGINT likewise) or SIGUSR1 (Slurm's --signal before the limit). Open MPI's mpirun
# passes SIGUSR1 on; on SIGTERM it ends the ranks itself (they still stop with a checkpoint, but mpirun
# exits 1), so SIGTERM goes through hvdtrain's horovodrun, which keeps mpirun in front of it.
# pod+mpirun: mpirun as a Kubernetes pod runs it, under hvdtrain's PID-1 entry (hvdtrain.cli.pod), which
# gets the pod's SIGTERM.
# (horovodrun --gloo: Ctrl-C below, which it passes on as it passes SIGTERM.)
LAUNCHER_SIGNALS = [("horovodrun-mpi", "SIGTERM"), ("torchrun", "SIGTERM"), ("torchrun", "SIGUSR1"),
                    ("mpirun", "SIGUSR1"), ("pod+mpirun", "SIGTERM")]


@pytest.mark.parametrize("launcher, name", LAUNCHER_SIGNALS)
def test_a_signal_to_the_launcher_stops_every_rank_with_a_checkpoint_and_leaves_nothing(launcher, name, ten_epochs,
                                                                                      tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    env = {**launch_env(), "HVDTRAIN_TEST_SIGNAL": "", "HVDTRAIN_TEST_DROPOUT": "0.2"}
    pod, launcher = launcher.startswith("pod+"), launcher.removeprefix("pod+")
    prefix = [sys.executable, "-m", "hvdtrain.cli.pod", *LAUNCHERS[launcher]] if pod else LAUNCHERS[launcher]
    extra = ["-x", "HVDTRAIN_TEST_SIGNAL", "-x", "HVDTRAIN_TEST_DROPOUT"] if launcher == "mpirun" else []
    job = subprocess.Popen([*prefix, *extra, "hvdtrain", "fit", *ARGS, "--epochs", "10",
                            "--run-dir", str(run_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "checkpoints" / "epoch-0002.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job.poll() is None and (run_dir / "checkpoints" / "epoch-0002.pt").exists(), "should be mid-training"
    launched = psutil.Process(job.pid)
    family = [launched, *launched.children(recursive=True)]
    signalled = time.monotonic()
    job.send_signal(getattr(signal, name))
    output, _ = job.communicate(timeout=30)
    assert job.returncode == 75, output[-3000:]
    # Inside epoch 3 as a rule; at the end of epoch 2 when it came during that epoch's checkpoint.
    said = re.findall(rf"hvdtrain: (stopped by {name} at (?:the end of )?epoch \d+, step [\d,]+)", output)
    assert len(said) == 1, output[-3000:]
    from hvdtrain.after.runs import read_run

    assert read_run(run_dir).status == said[0]  # `hvdtrain runs` says how it stopped, as rank 0 did
    assert "Traceback" not in output and "hvdtrain: error" not in output, output[-3000:]
    assert not (run_dir / "where.json").exists()  # rank 0 ended its own way, not killed by the launcher
    # Every process of the job is gone within 30 s (the ranks, mpirun, the launcher), not only the launcher.
    while [p for p in family if _alive(p)] and time.monotonic() < signalled + 30:
        time.sleep(0.1)
    assert not [p.cmdline() for p in family if _alive(p)]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["epoch"] >= 2  # at or after the end of the second epoch
    resumed = fit(launcher, run_dir, "--resume", "--epochs", "10")
    assert_ok(resumed)
    assert_same_weights(final_weights(ten_epochs), final_weights(run_dir), atol=1e-6)


# A closed terminal (an ssh session dropped, a laptop shut): the kernel hangs up the terminal's session leader,
# a shell, which passes SIGHUP to its jobs' process groups. This stand-in for it runs the job in a group of its
# own, under nohup or not (a login shell's job has SIGHUP's default, whatever `make test` itself was started
# under), and exits with its status.
SHELL = ("import os, signal, subprocess, sys\n"
         "hang_ups = signal.SIG_IGN if sys.argv[1] == 'nohup' else signal.SIG_DFL\n"
         "job = subprocess.Popen(sys.argv[2:], process_group=0, preexec_fn=lambda: signal.signal(signal.SIGHUP, "
         "hang_ups))\n"
         "def hang_up(number, frame):\n"
         "    try:\n"
         "        os.killpg(job.pid, signal.SIGHUP)\n"
         "    except ProcessLookupError:\n"
         "        pass\n"
         "signal.signal(signal.SIGHUP, hang_up)\n"
         "code = job.wait()\n"
         "sys.exit(code if code >= 0 else 128 - code)\n")
HANG_UPS = ["torchrun", "horovodrun-gloo", "horovodrun-mpi", "nohup+torchrun", "nohup+alone"]


@pytest.mark.parametrize("launcher", HANG_UPS)
def test_closing_the_terminal_stops_every_rank_with_a_checkpoint_unless_the_job_was_started_with_nohup(launcher,
                                                                                                       tmp_path):
    """Every rank stops at one step with a checkpoint (status 75), as for SIGTERM (torchrun's workers died of
    it; Horovod's Gloo launch lost a process of its own, whose successor printed tracebacks). Under nohup the
    job trains on to its end (torchrun's agent ended its workers)."""
    import fcntl
    import pty
    import termios

    import psutil

    from hvdtrain.after.runs import read_run

    nohup, launcher = launcher.startswith("nohup+"), launcher.removeprefix("nohup+")
    run_dir, log = tmp_path / "run", tmp_path / "log"
    master, terminal = pty.openpty()

    def on_the_terminal() -> None:  # the shell leads its session, the terminal its controlling one
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    with open(log, "w") as out:
        shell = subprocess.Popen([sys.executable, "-c", SHELL, "nohup" if nohup else "-",
                                  *LAUNCHERS.get(launcher, []), "hvdtrain", "fit", *ARGS, "--epochs", "6",
                                  "--run-dir", str(run_dir)], env={**launch_env(), "HVDTRAIN_TEST_SIGNAL": ""},
                                 stdin=terminal, stdout=out, stderr=subprocess.STDOUT, preexec_fn=on_the_terminal)
    os.close(terminal)
    family = []
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "checkpoints" / "epoch-0001.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert shell.poll() is None, log.read_text()[-3000:]
        family = psutil.Process(shell.pid).children(recursive=True)
    finally:
        os.close(master)  # the hang-up
    code = shell.wait(timeout=60)
    output = log.read_text()
    assert "Traceback" not in output and "hvdtrain: error" not in output, output[-3000:]
    if nohup:
        assert code == 0, output[-3000:]
        assert read_run(run_dir).status == "finished"
        return
    assert code == 75, output[-3000:]
    said = re.findall(r"hvdtrain: (stopped by SIGHUP at (?:the end of )?epoch \d+, step [\d,]+)", output)
    assert len(said) == 1, output[-3000:]
    assert read_run(run_dir).status == said[0]
    hung_up = time.monotonic()
    while [p for p in family if _alive(p)] and time.monotonic() < hung_up + 30:
        time.sleep(0.1)
    assert not [p.pid for p in family if _alive(p)]


@pytest.mark.parametrize("launcher", ["horovodrun-mpi", "horovodrun-gloo"])
def test_ctrl_c_in_a_terminal_stops_every_rank_with_a_checkpoint_however_long_it_takes(launcher, uninterrupted,
                                                                                      tmp_path):
    """Ctrl-C reaches every process of the terminal's foreground group: the launcher, and under MPI mpirun,
    which gave the ranks SIGTERM a second later and SIGKILL a second after that, in the stop's checkpoint
    (here 3 s). Under Gloo Horovod took the first rank to exit 75 for a failure and killed the others on
    their way out. Each stops at the step, writes its checkpoint, exits 75, and the resume is exact."""
    run_dir, group = tmp_path / "run", tmp_path / "group"
    env = {**launch_env(), "HVDTRAIN_TEST_SIGNAL": "0:5:SIGINT:terminal", "HVDTRAIN_TEST_TERMINAL": str(group),
           "HVDTRAIN_TEST_DROPOUT": "0.2", "HVDTRAIN_TEST_SLOW_SAVE": f"3:{tmp_path / 'saving'}"}
    job = subprocess.Popen([*LAUNCHERS[launcher], "hvdtrain", "fit", *ARGS, "--run-dir", str(run_dir)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    group.write_text(str(job.pid))  # the launcher leads its group, as a shell's job does
    try:
        output, _ = job.communicate(timeout=120)
    finally:
        left = _processes_of(run_dir, within=30)
        _kill(left)
    assert job.returncode == 75, output[-3000:]
    assert not left, [p.pid for p in left]  # every rank, mpirun and the launcher gone
    # At the step after the signal reached the ranks through the launcher: the fifth or a little later, or
    # on a loaded machine (its forwarding slow, the epoch's 12 steps quick) at the epoch's end.
    stopped = re.findall(r"hvdtrain: stopped by SIGINT at (the end of )?epoch 1, step (\d+): checkpoint written", output)
    assert len(stopped) == 1 and int(stopped[0][1]) >= 5, output[-3000:]
    if not stopped[0][0]:  # said at once, before the checkpoint's seconds: the key was heard, and what a second press costs
        heard = output.find(f"hvdtrain: SIGINT: every rank stops at epoch 1, step {stopped[0][1]}, writing a checkpoint "
                            "first")
        assert -1 < heard < output.find("hvdtrain: stopped by SIGINT"), output[-3000:]
    assert "Traceback" not in output and "failure" not in output, output[-3000:]
    assert not (run_dir / "where.json").exists()  # rank 0 ended its own way
    resumed = fit(launcher, run_dir, "--resume")
    assert_ok(resumed)
    assert_same_weights(final_weights(uninterrupted), final_weights(run_dir), atol=1e-6)


def test_torchrun_s_restarts_go_on_from_the_newest_checkpoint(uninterrupted, tmp_path):
    """torchrun --max-restarts 1 starts both workers again after rank 1 is killed in epoch 2: the restarted
    run goes on from epoch 1's checkpoint (it refused the directory, which held a run, and an --overwrite
    would have wiped that checkpoint) and ends with the uninterrupted run's weights."""
    run_dir = tmp_path / "run"
    env = {"HVDTRAIN_TEST_SIGNAL": f"1:{STEPS_PER_EPOCH + 5}:SIGKILL", "HVDTRAIN_TEST_DROPOUT": "0.2"}
    done = run(["torchrun", "--nproc-per-node", "2", "--max-restarts", "1", "hvdtrain", "fit", *ARGS, "--run-dir",
                str(run_dir), "--overwrite"], env={**launch_env(), **env}, timeout=180)
    assert_ok(done)
    assert "hvdtrain: torchrun started the workers again (restart 1): going on from the newest checkpoint" in done.stdout
    assert "hvdtrain: resuming from" in done.stdout and "(epoch 1, step 12)" in done.stdout, done.stdout[-3000:]
    assert_same_weights(final_weights(uninterrupted), final_weights(run_dir), atol=1e-6)


@pytest.mark.parametrize("case", ["bad input", "a stop signal"])
def test_torchrun_does_not_restart_what_a_restart_cannot_change(case, tmp_path):
    """--max-restarts starts the workers again after any failure: bad input (status 2) printed its line once
    per restart, and workers that stopped on a signal with a checkpoint (75) went on training."""
    bad = ["--data", "nothere"] if case == "bad input" else []
    env = {**launch_env(), "HVDTRAIN_TEST_SIGNAL": "" if bad else "1:5:SIGTERM", "HVDTRAIN_TEST_DROPOUT": "0.2"}
    done = run(["torchrun", "--nproc-per-node", "2", "--max-restarts", "2", "hvdtrain", "fit", *ARGS, *bad,
                "--run-dir", str(tmp_path / "run")], env=env, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == (2 if bad else 75), output[-3000:]
    assert output.count("hvdtrain: error: unknown data set" if bad else "hvdtrain: stopped by SIGTERM") == 1, output
    assert "started the workers again" not in output


def test_a_second_ctrl_c_as_the_ranks_have_left_is_no_crash(tmp_path):
    """Ctrl-C twice: the second came once the ranks had stopped on the first and left, and hvdtrain's
    horovodrun passed it to mpirun, which was ending the job: Open MPI's mpirun crashed in PMIx_Finalize (a
    segmentation fault, exit 139, not the ranks' 75). It reaches mpirun now only if mpirun is still there 10 s on."""
    import psutil

    run_dir, group = tmp_path / "run", tmp_path / "group"
    env = {**launch_env(), "HVDTRAIN_TEST_SIGNAL": "0:5:SIGINT:terminal", "HVDTRAIN_TEST_TERMINAL": str(group),
           "HVDTRAIN_TEST_DROPOUT": "0.2"}
    job = subprocess.Popen([*LAUNCHERS["horovodrun-mpi"], "hvdtrain", "fit", *ARGS, "--run-dir", str(run_dir)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    group.write_text(str(job.pid))
    try:
        heard = []
        for line in job.stdout:  # until rank 0 says the stop's checkpoint is written: the ranks leave then
            heard.append(line)
            if "hvdtrain: stopped by SIGINT" in line:
                break
        entry, deadline = psutil.Process(job.pid), time.monotonic() + 30
        while [p for p in _descendants(entry) if _is_rank(p)] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.poll() is None, "mpirun should still be ending the job once the ranks have left"
        os.killpg(job.pid, signal.SIGINT)  # the terminal's second Ctrl-C
        rest, _ = job.communicate(timeout=60)
        output = "".join(heard) + rest
    finally:
        _kill(_processes_of(run_dir, within=0))
    assert job.returncode == 75, output[-3000:]
    assert "Segmentation fault" not in output and "abort is already in progress" not in output, output[-3000:]


def _is_rank(process) -> bool:
    """A rank, by the variables its launcher gave it (not a shell or a probe whose command line names fit)."""
    import psutil

    try:
        return "OMPI_COMM_WORLD_RANK" in process.environ()
    except psutil.Error:
        return False


def _descendants(process) -> list:
    import psutil

    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


@pytest.mark.parametrize("launcher", ["horovodrun-mpi", "torchrun"])
def test_the_launcher_killed_ends_every_rank(launcher, tmp_path):
    """`kill -9` of the launcher (or `timeout -k`, or the out-of-memory killer) ends the job. horovodrun:
    mpirun runs in a process group of its own (Ctrl-C is the entry's to pass on), so the kill reaches the
    entry alone; mpirun, told of its parent's death, ends the ranks. torchrun: its workers, the agent's
    children, trained on as orphans (each printing a C++ traceback every 2 s as it published to the store
    the agent hosted); each now gets SIGTERM as the agent dies, and they stop with a checkpoint."""
    run_dir = tmp_path / "run"
    env = {**launch_env(), "HVDTRAIN_TEST_SIGNAL": "", "HVDTRAIN_TEST_DROPOUT": "0.2"}
    log = tmp_path / "log"
    with log.open("w") as out:
        job = subprocess.Popen([*LAUNCHERS.get(launcher, []), "hvdtrain", "fit", *ARGS, "--epochs", "5000", "--run-dir",
                                str(run_dir)], env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    job.kill()
    job.wait()
    left = _processes_of(run_dir, within=30)
    _kill(left)
    output = log.read_text()
    assert (run_dir / "checkpoints" / "last.pt").exists(), output[-3000:]
    assert not left, [p.pid for p in left]
    if launcher == "torchrun":
        assert re.search(r"hvdtrain: stopped by SIGTERM at (the end of )?epoch \d+, step \d+: checkpoint written",
                         output), output[-3000:]
        assert "Traceback" not in output and "sendBytes" not in output, output[-3000:]


def test_a_pod_s_command_that_outlives_its_ranks_gets_the_signal_after_they_stopped(tmp_path):
    """An MPIJob worker pod: PID 1's command (sshd there; `sleep` here) would never end by itself. The
    pod entry passes SIGTERM to the ranks below it, which stop with a checkpoint, then to the command,
    and exits with its status, well inside a grace period."""
    run_dir = tmp_path / "run"
    fit_line = " ".join(["mpirun", "-np", "2", "--oversubscribe", "-x", "HVDTRAIN_TEST_SIGNAL", "-x",
                         "HVDTRAIN_TEST_DROPOUT", "hvdtrain", "fit", *ARGS, "--epochs", "10", "--run-dir", str(run_dir)])
    job = subprocess.Popen([sys.executable, "-m", "hvdtrain.cli.pod", "bash", "-c", f"{fit_line}; exec sleep 1000"],
                           env={**launch_env(), "HVDTRAIN_TEST_SIGNAL": "", "HVDTRAIN_TEST_DROPOUT": "0.2"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "checkpoints" / "epoch-0002.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    signalled = time.monotonic()
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, output[-3000:]  # the command's status: sleep's, ended by it
    assert time.monotonic() - signalled < 30
    assert re.search(r"hvdtrain: stopped by SIGTERM at (the end of )?epoch", output), output[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["epoch"] >= 2


KILL_LAUNCHERS = ["horovodrun-gloo", "mpirun", "torchrun"]


def test_one_rank_killed_at_random_moments_stops_the_job_and_each_resume_is_exact(uninterrupted, tmp_path):
    """kill -9 of one rank at a random moment (set-up, a step, an allreduce, a checkpoint write,
    evaluation), under each launcher in turn: every process of the job is gone within 30 s, and
    `--resume auto` ends with the uninterrupted run's weights and records. HVDTRAIN_KILL_MOMENTS sets
    how many moments (3 in make test; `make test-kill` runs 20)."""
    import random

    import psutil

    moments = int(os.environ.get("HVDTRAIN_KILL_MOMENTS", "3"))
    seed = int(os.environ.get("HVDTRAIN_KILL_SEED", str(time.time_ns() % 10_000)))
    chance = random.Random(seed)
    training = run_summary(uninterrupted)["wall_s"]  # fit's own time, about
    for moment in range(moments):
        launcher, victim = KILL_LAUNCHERS[moment % 3], chance.randrange(2)
        # A quarter while the ranks start (imports, rendezvous, set-up); the rest once rank 0 has opened
        # the run directory: steps, allreduces, checkpoint writes, evaluation.
        starting = chance.random() < 0.25
        delay = chance.uniform(0.0, 2.0 if starting else training)
        phase = "after the ranks started" if starting else "into training"
        about = f"moment {moment} (HVDTRAIN_KILL_SEED={seed}): {launcher}, rank {victim}, {delay:.2f} s {phase}"
        run_dir = tmp_path / f"run{moment}"
        env = {**launch_env(), "HVDTRAIN_TEST_SIGNAL": "", "HVDTRAIN_TEST_DROPOUT": "0.2"}
        extra = ["-x", "HVDTRAIN_TEST_SIGNAL", "-x", "HVDTRAIN_TEST_DROPOUT"] if launcher == "mpirun" else []
        job = subprocess.Popen([*LAUNCHERS[launcher], *extra, "hvdtrain", "fit", *ARGS, "--checkpoint-every-steps", "5",
                                "--resume", "auto", "--run-dir", str(run_dir)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        launched = psutil.Process(job.pid)
        deadline = time.monotonic() + 30
        while len(ranks := _ranks(launched)) < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ranks) == 2, about
        family = [launched, *launched.children(recursive=True)]
        while not starting and not (run_dir / "config.yaml").exists() and job.poll() is None:
            time.sleep(0.01)
        time.sleep(delay)
        killed = time.monotonic()
        try:
            ranks[victim].kill()
        except psutil.NoSuchProcess:
            pass  # the job finished first: its resume has nothing to do
        output, _ = job.communicate(timeout=30)
        print(f"{about}: exit {job.returncode}, {output.count('epoch ')} epoch lines, {output[-300:]!r}")
        while [p for p in family if _alive(p)] and time.monotonic() < killed + 30:
            time.sleep(0.1)
        assert not [p.cmdline() for p in family if _alive(p)], about
        assert "Traceback" not in output, f"{about}\n{output[-3000:]}"
        resumed = fit(launcher, run_dir, "--resume", "auto", "--checkpoint-every-steps", "5")
        assert resumed.returncode == 0, f"{about}\n{resumed.stderr[-3000:]}"
        assert_same_weights(final_weights(uninterrupted), final_weights(run_dir), atol=1e-6)
        same_records(uninterrupted, run_dir)


def _ranks(launcher) -> dict:
    """The job's rank processes below the launcher, by rank."""
    import psutil

    found = {}
    for process in launcher.children(recursive=True):
        try:
            if not os.path.basename(process.exe()).startswith("python"):
                continue
            environ = process.environ()
        except psutil.Error:
            continue
        rank = next((environ[name] for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK") if name in environ), None)
        if rank is not None and "hvdtrain" in " ".join(process.cmdline()):
            found.setdefault(int(rank), process)
    return found


def _processes_of(run_dir: Path, within: float) -> list:
    """The processes whose command line names `run_dir` still alive after waiting up to `within` s."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        left = []
        for process in psutil.process_iter():
            try:
                if str(run_dir) in " ".join(process.cmdline()) and _alive(process):
                    left.append(process)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _kill(processes: list) -> None:
    import psutil

    for process in processes:
        try:
            process.kill()
        except psutil.Error:  # gone meanwhile
            pass


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

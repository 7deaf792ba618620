"""Rank 0's claim on its run directory (hvdtrain.io.run_lock), against other processes for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hvdtrain.errors import UserError
from hvdtrain.io import run_lock

# Another process holding the lock, as a running job's rank 0 would, with its note in the file.
HOLD = ("import fcntl, json, sys, time; f = open(sys.argv[1] + '/.hvdtrain.lock', 'a+'); "
        "fcntl.flock(f, fcntl.LOCK_EX); f.write(json.dumps({'host': 'node7', 'pid': 4242, 'slurm_job': '99', "
        "'slurm_restart': '0'})); "
        "f.flush(); print('held', flush=True); time.sleep(60)")


def _lockable_by_another_process(run_dir) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import fcntl, sys; fcntl.flock(open(sys.argv[1], 'r+'), "
                            "fcntl.LOCK_EX | fcntl.LOCK_NB)", str(run_dir / run_lock.LOCK_FILE)], capture_output=True,
                           timeout=60)
    return probe.returncode == 0


@pytest.fixture
def held(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield tmp_path
    holder.kill()
    holder.wait()


def test_a_claim_names_itself_and_ends_with_release(tmp_path):
    claimed = run_lock.claim(tmp_path)
    try:
        facts = json.loads((tmp_path / run_lock.LOCK_FILE).read_text())
        assert facts["pid"] == os.getpid() and not _lockable_by_another_process(tmp_path)
    finally:
        run_lock.release(claimed)
    assert _lockable_by_another_process(tmp_path)


def test_a_forked_child_does_not_keep_the_claim_past_its_parent_s_release(tmp_path):
    """A DataLoader worker forked during fit (one orphaned by a killed rank 0, or stuck in a user's
    __getitem__) shared the lock and kept the directory taken after rank 0 had let it go."""
    claimed = run_lock.claim(tmp_path)
    child = os.fork()
    if child == 0:
        time.sleep(20)
        os._exit(0)
    try:
        run_lock.release(claimed)
        assert _lockable_by_another_process(tmp_path)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_a_directory_another_process_holds_is_refused_naming_the_holder(held, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(UserError, match="another job is running in run directory .* \\(process 4242 on node7, "
                                        "Slurm job 99\\): wait for it or stop it"):
        run_lock.claim(held)


@pytest.mark.parametrize("restarts, taken_over", [("1", True), ("0", False)],
                         ids=["requeued", "another-step-of-the-same-allocation"])
def test_a_requeued_slurm_job_takes_over_its_own_last_allocation_s_lock(restarts, taken_over, held, monkeypatch,
                                                                         capsys):
    """A crashed node's lock that NFS still keeps, held for the same job before its requeue: not another
    job, so the requeued job goes on (a refusal would end it for good)."""
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    if taken_over:
        run_lock.claim(held)
        assert "still locked for this Slurm job's last allocation (process 4242 on node7" in capsys.readouterr().err
    else:  # the same job id in its first allocation: another job's step, not a predecessor
        with pytest.raises(UserError, match="another job is running"):
            run_lock.claim(held)


def test_letting_one_run_directory_go_keeps_the_others(tmp_path):
    """Two fits of one process (threads of a script) hold two directories: the end of one is not the
    other's (a release of every claim at a fit's end let the running one's go)."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    claims = run_lock.claim(first), run_lock.claim(second)
    try:
        run_lock.release(claims[0])
        assert _lockable_by_another_process(first) and not _lockable_by_another_process(second)
    finally:
        run_lock.release(claims[1])

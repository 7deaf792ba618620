"""Where every rank is: at a stall (the job stops, rank 0 says which rank is elsewhere, in which phase and
at which line of the user's code, and keeps every rank's stack), on demand (`hvdtrain where RUN_DIR`
from another terminal, the job goes on), and a slow rank named in the epoch's line."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LAUNCHERS, assert_ok, epoch_records, final_weights, fit_ok, launch_env, requires_launchers, run

pytestmark = [pytest.mark.multiprocess, requires_launchers]

STALL_TIMEOUT = 5
USER_CODE = str(Path(__file__).parent / "user_code.py")


def _user_line(text: str) -> int:
    """The line of tests/user_code.py that holds `text` (a stuck rank's frame)."""
    return next(number for number, line in enumerate(Path(USER_CODE).read_text().splitlines(), 1) if text in line)


def _stalled_job(launcher: str, run_dir: Path, *args: str) -> tuple[str, int, float]:
    """Runs fit until it stops; returns its output, exit status and the seconds from the moment a rank got stuck
    (the user code creates a file then) to the job's end."""
    stuck = run_dir.parent / f"{run_dir.name}.stuck"
    command = [*LAUNCHERS[launcher], "hvdtrain", "fit", "--progress", "off", "--set",
               f"train.stall_timeout={STALL_TIMEOUT}", "--run-dir", str(run_dir), *args]
    if launcher == "mpirun":
        command[len(LAUNCHERS[launcher]):len(LAUNCHERS[launcher])] = ["-x", "HVDTRAIN_TEST_STUCK_FILE"]
    job = subprocess.Popen(command, env={**launch_env(), "HVDTRAIN_TEST_STUCK_FILE": str(stuck)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode != 0 and stuck.exists(), output[-3000:]
    return output, job.returncode, time.time() - stuck.stat().st_mtime


def _assert_stall_report(output: str, run_dir: Path, stuck: str, code_line: int | None, stuck_rank: int = 1) -> None:
    """One error line; the stuck rank named with its phase and the user's frame (at `code_line` of
    user_code.py; None: in another process), first and last; every rank's whole stack in the run
    directory; nothing left running."""
    waiter = 1 - stuck_rank
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "hvdtrain: error:" in line]
    assert len(errors) == 1 and f"the job stalled: rank {waiter} waited" in errors[0], output[-3000:]
    assert f"not there: rank {stuck_rank} ({stuck}" in errors[0], errors[0]
    frame = f"{USER_CODE}:{code_line}" if code_line else ""
    assert re.search(rf"rank {stuck_rank} \(host .*\): {re.escape(stuck)}", output), output[-3000:]
    assert f"your code: {frame}" in output if code_line else "your code:" not in output, output[-3000:]
    last = [line for line in output.splitlines() if "hvdtrain: the job stopped waiting for" in line]
    assert len(last) == 1 and f"rank {stuck_rank} {stuck}" in last[0] and frame in last[0], output[-3000:]
    kept = sorted((run_dir / "where").glob("*-stall"))
    assert len(kept) == 1, list((run_dir / "where").iterdir()) if (run_dir / "where").exists() else "no where/"
    assert sorted(p.name for p in kept[0].iterdir()) == ["rank-0.txt", "rank-1.txt"]
    stuck_report = (kept[0] / f"rank-{stuck_rank}.txt").read_text()
    assert "Thread MainThread (most recent call last):" in stuck_report
    assert (f'"{USER_CODE}", line {code_line}' in stuck_report if code_line else
            "dataloader.py" in stuck_report), stuck_report
    assert "Thread MainThread" in (kept[0] / f"rank-{waiter}.txt").read_text()
    assert not (run_dir / "where.json").exists()  # no job answers there any more
    from hvdtrain.after.runs import read_run

    ended = read_run(run_dir)  # `hvdtrain runs` says it failed, not that it crashed
    assert ended.status.startswith("failed in epoch") and ended.error.startswith("the job stalled"), ended.status
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left: {left}"


@pytest.mark.parametrize("launcher", ["horovodrun-mpi", "horovodrun-gloo", "torchrun"])
def test_a_rank_stuck_in_its_forward_is_named_with_its_line_and_every_stack_is_kept(launcher, tmp_path):
    """Rank 1 sleeps for ever in its model's 5th training forward (step 5): rank 0 waits in the gradient
    allreduce; within the stall timeout + 10 s the job stops naming rank 1, `forward` and the line."""
    run_dir = tmp_path / "run"
    output, code, seconds = _stalled_job(launcher, run_dir, "--model", "user_code:stuck_on_rank_1")
    assert seconds < STALL_TIMEOUT + 10, f"stopped {seconds:.0f} s after the stall\n{output[-3000:]}"
    _assert_stall_report(output, run_dir, "in forward at epoch 1, training after step 4",
                         _user_line("time.sleep(1)  # a rank stuck in its forward"))
    assert "in the gradient allreduce at epoch 1, training after step 4" in output


def test_rank_0_stuck_itself_is_reported_by_its_own_report_thread(tmp_path):
    """Rank 1 waits, asks rank 0; rank 0's training thread sleeps in the user's forward while its report
    thread answers, names itself as the one not there, and ends the job."""
    run_dir = tmp_path / "run"
    output, code, seconds = _stalled_job("torchrun", run_dir, "--model", "user_code:stuck_on_rank_0")
    assert seconds < STALL_TIMEOUT + 10, f"stopped {seconds:.0f} s after the stall\n{output[-3000:]}"
    _assert_stall_report(output, run_dir, "in forward at epoch 1, training after step 4",
                         _user_line("time.sleep(1)  # a rank stuck in its forward"), stuck_rank=0)


@pytest.mark.parametrize("launcher, workers", [("mpirun", 0), ("torchrun", 0), ("horovodrun-gloo", 1)])
def test_a_rank_stuck_reading_its_data_is_named_in_data_loading(launcher, workers, tmp_path):
    """With a data-loader worker, the read hangs in the worker: the rank waits for it in data loading
    (its stack shows the loader's wait; the worker's own frames are another process's), and the worker
    is ended with its rank, though it leaves the stop signals to its rank."""
    run_dir = tmp_path / "run"
    output, code, seconds = _stalled_job(launcher, run_dir, "--data", "user_code:stuck_reading_on_rank_1",
                                         "--batch-size", "16", "--set", f"data.num_workers={workers}")
    assert seconds < STALL_TIMEOUT + 10, f"stopped {seconds:.0f} s after the stall\n{output[-3000:]}"
    _assert_stall_report(output, run_dir, "in data loading at epoch 1, training after step ",
                         _user_line("time.sleep(1)  # rank 1 stuck reading its data") if not workers else None)


def test_a_rank_that_never_reaches_evaluation_s_collective_is_named(tmp_path):
    """Rank 1 hangs reading its first validation sample; rank 0 waits in evaluation's allreduce."""
    run_dir = tmp_path / "run"
    output, code, seconds = _stalled_job("horovodrun-gloo", run_dir, "--data", "user_code:stuck_before_evaluation_on_rank_1",
                                         "--batch-size", "16")
    assert seconds < STALL_TIMEOUT + 10, f"stopped {seconds:.0f} s after the stall\n{output[-3000:]}"
    _assert_stall_report(output, run_dir, "in evaluation at epoch 1",
                         _user_line("time.sleep(1)  # rank 1 stuck reading its data"))


# --- on demand


def _where_while_it_runs(job: subprocess.Popen, held: list[Path], run_dir: Path) -> subprocess.CompletedProcess:
    """`hvdtrain where RUN_DIR` from another process, once every rank says it is held."""
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in held):
        assert job.poll() is None, job.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the ranks never reached their hold"
        time.sleep(0.1)
    assert (run_dir / "where.json").exists()
    elsewhere = run_dir.parent / "elsewhere"  # not the job's working directory
    elsewhere.mkdir()
    return run(["hvdtrain", "where", str(run_dir)], timeout=60, cwd=elsewhere)


@pytest.mark.parametrize("launcher", ["horovodrun-mpi", "torchrun"])
def test_where_shows_every_rank_s_stack_of_a_live_run_which_then_ends_as_if_never_asked(launcher, tmp_path, request):
    """The job holds in step 3 until the test has asked (its model waits for a file), then finishes with the
    weights of the session's digits run under the same launcher and engine, never asked (the hold only waits;
    that run's step log and Horovod timeline change no weight)."""
    args = ["--progress", "off", "--epochs", "3"]
    asked_dir, release = tmp_path / "asked", tmp_path / "release"
    prefix = [*LAUNCHERS[launcher], *(["-x", "HVDTRAIN_TEST_RELEASE_FILE"] if launcher == "mpirun" else [])]
    job = subprocess.Popen([*prefix, "hvdtrain", "fit", *args, "--model", "user_code:held_until_released",
                            "--run-dir", asked_dir.name], env={**launch_env(), "HVDTRAIN_TEST_RELEASE_FILE": str(release)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        where = _where_while_it_runs(job, [tmp_path / f"release.held-{rank}" for rank in (0, 1)], asked_dir)
        release.touch()
        output, _ = job.communicate(timeout=120)
    finally:
        release.touch()
        job.kill()
    assert_ok(where)
    assert job.returncode == 0, output[-3000:]
    text = where.stdout
    assert text.startswith("hvdtrain where: 2 ranks; every rank's whole stack in"), text
    kept = sorted((asked_dir / "where").iterdir())
    assert text.splitlines()[0].endswith(f" in {kept[0]}"), text  # the job's relative --run-dir, made absolute
    line = _user_line("time.sleep(0.1)  # held until the test has asked")
    for rank in (0, 1):
        assert re.search(rf"^  rank {rank} \(host .*, pid \d+\): in forward at epoch 1, training after step 2", text,
                         re.M), text
    assert text.count(f"your code: {USER_CODE}:{line} in forward") == 2, text
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert all(f'"{USER_CODE}", line {line}' in (kept[0] / name).read_text() for name in ("rank-0.txt", "rank-1.txt"))
    assert not (asked_dir / "where.json").exists()  # removed at the end: no job runs there now
    plain_dir, _ = request.getfixturevalue("digits_np2" if launcher == "horovodrun-mpi" else "digits_torchrun")
    asked = {name.removeprefix("inner."): value for name, value in final_weights(asked_dir).items()}
    plain = final_weights(plain_dir)
    assert asked.keys() == plain.keys() and all((asked[k] == plain[k]).all() for k in plain)


def test_where_says_in_one_line_when_no_job_runs_there_or_its_file_is_not_a_job_s(tmp_path):
    done = run([sys.executable, "-m", "hvdtrain", "where", str(tmp_path)], timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"hvdtrain: error: no job is running in {tmp_path} (no where.json: it ended, has not reached its first "
        "epoch yet, runs as one process without a launcher, or runs with --elastic)"]
    (tmp_path / "where.json").write_text('{"host": "localhost", "port": 99999, "token": "x", "pid": 1}')
    done = run([sys.executable, "-m", "hvdtrain", "where", str(tmp_path)], timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"hvdtrain: error: {tmp_path / 'where.json'} is not what a running job writes (host, port, token, pid): "
        "remove it"]


# --- slow ranks


def test_a_rank_slow_to_read_its_data_is_named_as_a_straggler(tmp_path):
    """Rank 1 reads each sample 8 ms slower: every epoch's line names it, with data as the cause. (Even
    ranks name none: test_multiprocess.py's run under each launcher checks that.)"""
    slow = fit_ok("horovodrun-gloo", "--data", "user_code:slow_reading_on_rank_1", "--epochs", "2",
                  "--batch-size", "16", "--run-dir", str(tmp_path / "slow"))
    lines = [line for line in slow.stdout.splitlines() if re.search(r"epoch \d/2 ", line)]
    assert len(lines) == 2, slow.stdout
    for line in lines:
        assert re.search(r"slow: rank 1: \d+\.\dx the others' median step, \d+% waiting for data: raise "
                         r"data.num_workers", line), line
    records = epoch_records(tmp_path / "slow")
    assert all(len(r["rank_data_s"]) == 2 and r["rank_data_s"][1] > r["rank_data_s"][0] for r in records)
    assert all(r["stragglers"].startswith("rank 1: ") and "rank 0" not in r["stragglers"] for r in records)

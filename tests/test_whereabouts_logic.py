"""In-process parts of where-is-every-rank: the report channel between threads of this process, a rank's
clock, and the straggler rule."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from hvdtrain.engine.activity import Activity
from hvdtrain.engine.report_channel import RankLink, ReportServer, request
from hvdtrain.engine.stacks import main_frames, rank_report, state, user_frames
from hvdtrain.engine.whereabouts import stall_lines
from hvdtrain.train.stragglers import RankTimes, stragglers


@pytest.fixture
def server():
    served = ReportServer(lambda asked: {"text": f"asked {asked['ask']}"})
    yield served
    served.close()


def test_a_rank_s_phase_is_said_once():
    """`where` reads `epoch 2, evaluation` in evaluation, and `set-up` in set-up, for the collectives' reports."""
    assert Activity(where="epoch 2, evaluation", phase="evaluation").describe() == "in evaluation at epoch 2"
    assert Activity().describe() == "in set-up"
    assert Activity(where="epoch 1, step 3", phase="forward").describe() == "in forward at epoch 1, step 3"
    report = rank_report(0, "cpu", Activity(where="epoch 2, evaluation", phase="evaluation"))
    assert state(report).startswith("in evaluation at epoch 2, for ")


def test_a_malformed_or_unauthorised_caller_leaves_the_server_answering(server):
    for garbage in (b"[1]\n", b"not json\n", b'{"token": 5}\n', b'{"token": "wrong", "ask": "where"}\n'):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(garbage)
            sock.settimeout(5)
            assert sock.recv(100) == b""  # closed without a word
    silent = socket.create_connection(("127.0.0.1", server.port))  # says nothing: holds up no one
    try:
        answer = request("127.0.0.1", server.port, {"token": server.token, "ask": "where"}, 5)
    finally:
        silent.close()
    assert answer == {"text": "asked where"}


def test_a_wrong_token_gets_no_acknowledgement(server):
    with pytest.raises(OSError, match="closed without acknowledging"):
        request("127.0.0.1", server.port, {"token": "0" * 32, "ask": "where"}, 5)


def test_rank_0_gets_every_linked_rank_s_report_and_none_for_a_silent_one(server, monkeypatch):
    """Rank 1 answers; rank 2 answers too late the first time (its late answer is not taken for the next
    ask's); rank 3 never linked."""
    import hvdtrain.engine.report_channel as channel

    monkeypatch.setattr(channel, "ANSWER_SECONDS", 0.5)
    slow_once = iter([1.0])
    links = [RankLink.connect(1, ["127.0.0.1"], server.port, server.token, lambda: {"rank": 1}),
             RankLink.connect(2, ["127.0.0.1"], server.port, server.token,
                              lambda: time.sleep(next(slow_once, 0)) or {"rank": 2})]
    assert all(link is not None and why == "" for link, why in links)
    try:
        deadline = time.monotonic() + 5
        while len(server.links) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.ask_all(4, lambda: {"rank": 0}) == [{"rank": 0}, {"rank": 1}, None, None]
        time.sleep(1.0)  # rank 2's late answer arrives meanwhile
        assert server.ask_all(4, lambda: {"rank": 0}) == [{"rank": 0}, {"rank": 1}, {"rank": 2}, None]
    finally:
        for link, _ in links:
            link.close()


def test_a_stall_report_names_a_rank_that_did_not_answer_in_words():
    """A rank stopped (SIGSTOP, a debugger) or held in native code cannot answer: every line still reads."""
    mine = Activity(where="epoch 8, training after step 79", collective="the gradient allreduce", since=time.time() - 16)
    lines = stall_lines(0, mine, 10, [{"rank": 0}, None], None)
    assert lines[0].startswith("hvdtrain: error: the job stalled: rank 0 waited 16 s in the gradient allreduce at "
                               "epoch 8, training after step 79 (train.stall_timeout 10 s); not there: rank 1 (no answer).")
    assert lines[2:] == ["  rank 0: waiting in the gradient allreduce at epoch 8, training after step 79",
                         "  rank 1: no answer within 5 s (gone, or its interpreter held in native code)",
                         "hvdtrain: the job stopped waiting for rank 1, which did not answer"]


def test_a_rank_waiting_in_horovod_is_shown_in_horovod_s_wait_not_in_the_polite_loop_around_it():
    import hvdtrain
    from hvdtrain.engine import whereabouts

    ours, site = os.path.dirname(hvdtrain.__file__), os.path.dirname(os.path.dirname(torch.__file__))
    frames = [[f"{ours}/train/loop.py", 10, "apply_gradients", "engine.synchronize(optimizer)"],
              [f"{site}/horovod/torch/optimizer.py", 284, "synchronize", "output = synchronize(handle)"],
              [f"{site}/horovod/torch/mpi_ops.py", 1285, "synchronize", "mpi_lib.horovod_torch_wait_and_clear(handle)"],
              [f"{ours}/engine/horovod_wait.py", 60, "wait_and_clear", "wait_politely(...)"],
              [f"{ours}/engine/horovod_wait.py", 45, "wait_politely", "time.sleep(...)"]]
    report = {"rank": 0, "host": "h", "pid": 1, "device": "cpu", "where": "epoch 1, training after step 4",
              "phase": "compute", "phase_for": 3.0, "collective": "the gradient allreduce", "collective_for": 3.0,
              "stacks": [{"thread": "MainThread", "frames": frames}]}
    lines = whereabouts._rank_lines(0, report, stack=True)
    assert [line.split(":", 1)[1].split(" in ")[0].strip() for line in lines[1:]] == \
        [f"{site}/horovod/torch/mpi_ops.py:1285", f"{site}/horovod/torch/optimizer.py:284"], lines


def test_a_link_to_a_port_that_is_not_rank_0_s_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as other:  # listens, never acknowledges
        link, why = RankLink.connect(1, ["127.0.0.1"], other.getsockname()[1], "t", dict)
    assert link is None and "no acknowledgement" in why, why


def test_a_report_has_the_main_thread_first_and_tells_the_user_s_frames_from_the_library_s():
    activity = Activity()
    activity.enter("forward")
    reports = []
    reader = threading.Thread(target=lambda: reports.append(rank_report(3, "cpu", activity)), name="reader")
    reader.start()
    reader.join()  # the main thread waits here, as a training thread would wait somewhere
    report = reports[0]
    assert report["rank"] == 3 and report["phase"] == "forward" and report["collective"] is None
    assert report["stacks"][0]["thread"] == "MainThread"
    assert "reader" not in [stack["thread"] for stack in report["stacks"]]  # not the thread writing it
    users = user_frames(main_frames(report))
    assert [(f[0], f[2]) for f in users] == [(__file__, "test_a_report_has_the_main_thread_first_and_tells_the_user_s_frames_from_the_library_s")]


def test_the_clock_leaves_collective_waits_out_of_data_and_compute_and_rank_0_s_extras_out_of_both():
    activity = Activity()
    start = activity.clock()
    activity.enter("data loading")
    time.sleep(0.05)
    activity.enter("forward")
    time.sleep(0.05)
    activity.enter("the optimizer step")
    with activity.waiting("the gradient allreduce"):
        time.sleep(0.1)
    activity.enter("a checkpoint write")
    time.sleep(0.05)
    data, compute, waited, total = (now - then for now, then in zip(activity.clock(), start))
    assert 0.05 <= data < 0.1 and 0.05 <= compute < 0.1 and 0.1 <= waited < 0.2  # a busy machine sleeps longer
    assert total - data - compute - waited >= 0.05  # the write: `other`


def _times(data, compute, waited, other=None):
    return RankTimes(data, compute, waited, other or [0.0] * len(data))


def test_stragglers_names_a_rank_slow_in_data_with_its_cause_and_none_when_ranks_are_even():
    slow = _times([0.1, 3.0, 0.1, 0.1], [1.0, 1.0, 1.1, 0.9], [3.0, 0.2, 3.0, 3.1])
    assert stragglers(slow, 1.5) == ("rank 1: 3.6x the others' median step, 75% waiting for data: raise "
                                     "data.num_workers, or make its reads faster")
    even = _times([0.1, 0.12, 0.1, 0.11], [1.0, 1.1, 0.95, 1.05], [0.2, 0.1, 0.25, 0.15])
    assert stragglers(even, 1.5) is None
    assert stragglers(slow, 0) is None  # off


def test_stragglers_names_a_rank_slow_in_compute_and_not_rank_0_for_its_checkpoint_writes():
    busy_host = _times([0.1, 0.1], [1.0, 2.5], [1.6, 0.1])
    assert stragglers(busy_host, 1.5).startswith("rank 1: 2.4x the others' median step, 96% computing")
    writing = _times([0.1, 0.1], [1.0, 1.0], [0.1, 2.1], other=[2.0, 0.0])
    assert stragglers(writing, 1.5) is None


def test_a_difference_too_small_to_matter_is_not_named():
    tiny = _times([0.001, 0.001], [0.01, 0.05], [0.05, 0.01])  # 4x, but 0.04 s of a 0.06 s epoch
    assert stragglers(tiny, 1.5) is None
    # A busy host's hiccup: rank 1 held back half a second in an epoch of about one (a loaded CI machine).
    hiccup = _times([0.0438, 0.5465], [0.0628, 0.0775], [0.9014, 0.1947], other=[0.001, 0.0736])
    assert stragglers(hiccup, 1.5) is None


def _watched(activity: Activity, ended: list[int], change=None) -> None:
    """A watchdog (train.stall_timeout 1, no board) over `activity` until it ends the process (noted in
    `ended`) or 5 s pass; `change(activity)` after 0.6 s, when nothing may have ended it yet."""
    from hvdtrain.engine import watchdog

    dog = watchdog.StallWatchdog(activity, None, 1, rank=lambda: 0, size=lambda: 2).start()
    try:
        if change is not None:
            time.sleep(0.6)
            assert ended == []
            change(activity)
        deadline = time.monotonic() + 5
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.stop()


def test_a_collective_of_set_up_waits_a_minute_at_least_and_one_of_training_the_stall_timeout(monkeypatch, capsys):
    """Ranks set up unevenly (imports from a cold shared file system, their own data): a rank 30 s ahead
    in set-up is no stall with train.stall_timeout 1; the same wait in training is, and a minute in set-up."""
    from hvdtrain.engine import watchdog
    from hvdtrain.engine.activity import wait_rule

    ended: list[int] = []
    monkeypatch.setattr(watchdog, "end_process", ended.append)
    _watched(Activity(collective="allgather 'agree.setup'", since=time.time() - 30), ended,
             change=lambda activity: activity.at("epoch 1, step 3"))
    assert ended[:1] == [1]
    assert "at epoch 1, step 3 (train.stall_timeout 1 s); not there: rank 1 (never reported)" in capsys.readouterr().err
    ended.clear()
    _watched(Activity(collective="allgather 'agree.setup'", since=time.time() - 61), ended)
    assert ended[:1] == [1]
    assert "at set-up (train.stall_timeout 1 s, 60 s at least in set-up)" in capsys.readouterr().err
    assert wait_rule("set-up", 5) == "train.stall_timeout 5 s, 60 s at least in set-up"
    # Waiting while rank 0 makes the data first (a download): what to do about that, not a mismatch of collectives.
    advice = ("makes the data (a download, a cache): fetch it before the job, or raise train.stall_timeout; a "
              "factory that waits for the other ranks itself (a barrier) needs --set data.in_turn=false")
    first = Activity(collective="allgather 'agree.data_first.0'", since=time.time() - 61)
    ended.clear()
    _watched(first, ended)
    assert ended[:1] == [1]
    assert capsys.readouterr().err.endswith(f"; not there: rank 1 (never reported). The others wait while rank 0, "
                                            f"then each other host's first rank, {advice}\n")
    assert stall_lines(1, first, 300, [None, {"rank": 1}], None)[0].endswith(advice)
    assert wait_rule("set-up", 300) == "train.stall_timeout 300 s"


SUSPENDED_IN_A_COLLECTIVE = """
import os, sys, time
from hvdtrain.engine.activity import Activity
from hvdtrain.engine.watchdog import StallWatchdog
activity = Activity()
activity.at("epoch 1, step 3")
dog = StallWatchdog(activity, None, 2, rank=lambda: 0, size=lambda: 2).start()
with activity.waiting("the gradient allreduce"):  # the other rank's part: the test's word on stdin
    print("waiting", flush=True)
    sys.stdin.readline()
dog.stop()
print("done", flush=True)
"""


def test_a_job_stopped_and_continued_inside_a_collective_is_no_stall():
    """Ctrl-Z and fg, or Slurm's `scontrol suspend` and `resume`: 3 s stopped in a collective with
    train.stall_timeout 2 is no stall once continued; the 1.3 s it waited while it ran are not one either."""
    import contextlib
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", SUSPENDED_IN_A_COLLECTIVE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "waiting\n"
        time.sleep(0.3)
        child.send_signal(signal.SIGSTOP)
        time.sleep(3)
        child.send_signal(signal.SIGCONT)
        time.sleep(1.0)
        with contextlib.suppress(BrokenPipeError):  # ended by a stall report meanwhile: asserted below
            child.stdin.write("go\n")
            child.stdin.flush()
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert (child.returncode, out, err) == (0, "done\n", "")


def test_a_store_call_that_blocks_is_not_taken_for_time_stopped(monkeypatch, capsys):
    """A board whose every publish blocks 1.5 s and fails (the store's host frozen or cut off): those
    seconds are the watchdog's own, not the process stopped, and the stall is still reported in time."""
    from hvdtrain.engine import watchdog

    class StuckStore:
        def publish(self, rank, activity):
            time.sleep(1.5)
            raise OSError("the store did not answer")

        def read(self, rank):
            return None

    ended: list[int] = []
    monkeypatch.setattr(watchdog, "end_process", ended.append)
    activity = Activity(collective="the gradient allreduce", since=time.time())
    activity.at("epoch 1, step 3")
    dog = watchdog.StallWatchdog(activity, StuckStore(), 1, rank=lambda: 0, size=lambda: 2).start()
    try:
        deadline = time.monotonic() + 5  # about 2 s: two passes; taken for stopped time, 8 s
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.stop()
    assert ended[:1] == [1]
    assert "rank 0 waited" in capsys.readouterr().err

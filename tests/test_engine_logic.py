"""Engine paths whose trigger is a GPU or a change of processes, shown in one process on the CPU:
the host's wait for NCCL named, optimizer state sent from the host, elastic attempts' run files."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from hvdtrain.config import Config
from hvdtrain.engine.local import LocalEngine
from hvdtrain.engine.torch_distributed import TorchEngine
from hvdtrain.engine.watchdog import Activity


def test_the_host_waits_for_nccl_inside_the_named_gradient_allreduce(monkeypatch):
    """With NCCL, work.wait() only orders the GPU's streams: the host must block on the stream inside
    the collective the stall watchdog names, not later in the loss's bool()."""
    engine = TorchEngine.__new__(TorchEngine)  # no process group: only the host's waiting is exercised
    engine.device, engine.activity = torch.device("cuda", 0), Activity()
    engine._gradients = SimpleNamespace(wait=lambda: None)
    seen: list[str | None] = []

    class Stream:
        def synchronize(self) -> None:
            seen.append(engine.activity.collective)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    assert engine.synchronize(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    assert seen == ["the gradient allreduce"]
    assert engine.activity.collective is None


def test_optimizer_state_travels_as_host_tensors_of_its_own(monkeypatch):
    """dist: rank 0 sends copies made by .cpu(), never the optimizer's own (device) tensors: pickled
    CUDA tensors would be unpickled onto cuda:0 on every rank."""
    sent: list = []

    class RankZeroOfTwo(LocalEngine):
        def __init__(self, device: torch.device):
            super().__init__(device)
            self.size = 2

        def broadcast_object(self, obj, name):
            sent.append(obj)
            return obj

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    copied = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda tensor: copied(tensor).clone())  # a copy, as from a GPU
    RankZeroOfTwo(torch.device("cpu")).broadcast_optimizer_state(optimizer)
    own = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    travelled = [t for state in sent[0]["state"].values() for t in state.values() if isinstance(t, torch.Tensor)]
    assert len(travelled) == len(own) == 6  # step, exp_avg, exp_avg_sq of weight and bias
    assert not any(t is mine for t in travelled for mine in own)
    assert all(t.device.type == "cpu" for t in travelled)


class _Interrupted(Exception):
    """A change of processes, as Horovod's elastic state raises it at a commit."""


class _OneChangeOfProcesses(LocalEngine):
    """One process whose elastic loop sees one change: the first attempt ends at its second commit."""

    def require_elastic(self) -> None:
        pass

    def is_engine_signal(self, err: BaseException) -> bool:
        return isinstance(err, _Interrupted)

    def elastic_state(self, model, optimizer, before_sync, **objects):
        before_sync()
        commits = []

        class State(SimpleNamespace):
            def commit(self) -> None:
                commits.append(1)
                if len(commits) == 2:
                    raise _Interrupted

        return State(**objects)

    def run_elastic(self, train, state):
        with contextlib.suppress(_Interrupted):
            return train(state)
        return train(state)


def test_each_elastic_attempt_s_run_files_are_closed(tmp_path, monkeypatch):
    """An attempt ended by a change of processes leaves its TensorBoard writer open unless the next
    attempt closes it; the last attempt's files close when fit ends."""
    from hvdtrain.io.run_dir import RunFiles
    from hvdtrain.train import fit, loggers

    opened = []

    class Recording(RunFiles):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.closed = []
            opened.append(self.closed)

        def close(self):
            self.closed.append(1)
            super().close()

    monkeypatch.setattr(loggers, "RunFiles", Recording)
    config = Config.from_dict({"data": {"name": "random", "samples": 256}, "train": {"epochs": 2, "elastic": True,
                                                                                    "commit_every": 1},
                               "run": {"dir": str(tmp_path / "run"), "progress": "off"}})
    summary = fit.fit(config, _OneChangeOfProcesses(torch.device("cpu")))
    assert summary["epochs"] == 2
    assert len(opened) == 2, "two attempts, each with its own run files"
    assert all(closed == [1] for closed in opened), opened



def test_a_later_horovod_start_follows_its_own_settings_and_the_user_s_still_win(monkeypatch):
    """Horovod reads its stall and timeline variables at init; a second fit in a process (the Python API)
    sets them anew, where hvdtrain had set them, and leaves those the user set alone."""
    from hvdtrain.engine import horovod_start as horovod

    monkeypatch.setattr(horovod, "_ours", {})
    for name in ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_TIMELINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "999")  # the user's
    horovod.set_ours("HOROVOD_STALL_CHECK_TIME_SECONDS", "315")
    horovod.set_ours("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "330")
    horovod.set_ours("HOROVOD_TIMELINE", "DYNAMIC", over_theirs=True)
    assert [os.environ.get(n) for n in ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                        "HOROVOD_TIMELINE")] == ["315", "999", "DYNAMIC"]
    # The next start: a longer stall timeout, none for shutdown, no timeline.
    horovod.set_ours("HOROVOD_STALL_CHECK_TIME_SECONDS", "1215")
    horovod.set_ours("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", None)
    horovod.set_ours("HOROVOD_TIMELINE", None)
    assert [os.environ.get(n) for n in ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                        "HOROVOD_TIMELINE")] == ["1215", "999", None]


def test_sharded_collectives_run_on_a_torch_without_2_13_s_names(monkeypatch, tmp_path):
    """A GPU image's torch 2.11 has reduce_scatter_tensor and all_gather_into_tensor, not the names torch
    2.13 gave them (reduce_scatter_single, all_gather_single): --shard-optimizer failed at its first step
    there. With the new names gone, the torch engine's segments take the old ones, on a real group."""
    import warnings

    import torch.distributed as dist

    from hvdtrain.engine.torch_distributed import _TorchSegments

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)  # absent before torch 2.13
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
        segments = _TorchSegments(SimpleNamespace(rank=0, size=1, allreduce_sum=None))
        flat = torch.arange(6, dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old names are deprecated in 2.13
            received = segments.wait(segments.reduce_scatter(flat, "grads"))
            gathered = segments.wait(segments.all_gather(received * 2, "params"))
        assert torch.equal(received, flat) and torch.equal(gathered, flat * 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["allreduce", "sharded", "bf16"])
def test_backward_under_the_torch_engine_s_gradient_hooks_never_waits_for_the_gpu(tmp_path, exchange):
    """A host wait in a gradient hook (a flag tensor copied from pageable memory, a list index) made backward
    itself wait for the GPU: the next batch was then loaded with the GPU idle, and fit under torchrun made
    0.54 of a plain loop on a ResNet-50 in bf16. Under CUDA's sync debug mode any such wait raises."""
    import torch.distributed as dist

    from hvdtrain.engine.bf16_average import Bf16Average
    from hvdtrain.engine.sharded import ShardedGradients
    from hvdtrain.engine.torch_distributed import _OverlappedAverage, _TorchSegments

    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=device)
    try:
        torch.manual_seed(0)
        # 1.6 M parameters: a first bucket of 1 MB, then others, each started from a hook during backward
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(device)
        params = list(model.parameters())
        segments = _TorchSegments(SimpleNamespace(rank=0, size=1, allreduce_sum=None))
        averaged = {"allreduce": lambda: _OverlappedAverage(params, 1, 1, "none"),
                    "sharded": lambda: ShardedGradients(params, segments, 1, "none"),
                    "bf16": lambda: Bf16Average(params, segments, 1)}[exchange]()
        x = torch.randn(64, 512, device=device)
        plain = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square().mean())(
            {name: p.detach() for name, p in model.named_parameters()})

        def step(watched: bool) -> None:
            model.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            torch.cuda.set_sync_debug_mode("error" if watched else "default")
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert averaged.hooks.started == len(averaged.hooks.buckets) > 1  # every bucket started in backward
            averaged.wait()

        step(watched=False)  # NCCL's communicator starts at the first collective
        step(watched=True)
        for name, param in model.named_parameters():
            expected = plain[name].bfloat16().float() if exchange == "bf16" else plain[name]
            assert torch.allclose(param.grad, expected, rtol=1e-2 if exchange == "bf16" else 1e-5, atol=1e-6), name
    finally:
        dist.destroy_process_group()


_SHUTDOWN_THAT_HANGS = """
import time
import torch
import hvdtrain.engine as engines
from hvdtrain.engine.local import LocalEngine

class HangsInShutdown(LocalEngine):
    def shutdown(self, finished=False):
        time.sleep(120)  # as Horovod's, in MPI_Finalize for a rank that deadlocked inside Horovod

def report(err):
    print("hvdtrain: error: rank 1 failed", flush=True)
    raise SystemExit(3)

class TwoRanks(HangsInShutdown):
    def __init__(self, device):
        super().__init__(device)
        self.size = 2

engines.FAILED_SHUTDOWN_SECONDS = 1.0
engines.start_engine = lambda **settings: TwoRanks(torch.device("cpu"))
with engines.running_engine(report, process_goes_on=False):
    raise RuntimeError("a data-loader worker was killed")
"""

_SLOW_EXIT_HANDLER_AFTER_A_SHUTDOWN = """
import atexit, time
import torch
import hvdtrain.engine as engines
from hvdtrain.engine.local import LocalEngine

class TwoRanks(LocalEngine):
    def __init__(self, device):
        super().__init__(device)
        self.size = 2

def report(err):
    raise SystemExit(3)

atexit.register(lambda: (time.sleep(2), print("the exit handler ran", flush=True)))
engines.FAILED_SHUTDOWN_SECONDS = 1.0
engines.start_engine = lambda **settings: TwoRanks(torch.device("cpu"))
with engines.running_engine(report, process_goes_on=False):
    raise RuntimeError("a data-loader worker was killed")
"""


def test_a_rank_leaving_on_its_failure_exits_by_the_deadline_when_the_shutdown_hangs():
    """A rank deadlocked inside Horovod (its main thread holding Python's lock as it enqueued a collective,
    Horovod's thread finalizing on the failure waiting for that lock) held the failed rank in MPI_Finalize for
    ever, and the job with it: no watchdog of Python's runs in the deadlocked rank, and the launcher waits
    for a rank to exit. The failed rank, its line said, now exits with its status."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _SHUTDOWN_THAT_HANGS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout == "hvdtrain: error: rank 1 failed\n", done
    assert time.monotonic() - started < 30
    # The deadline is the shutdown's alone: the exit handlers after it take the time they need.
    done = subprocess.run([sys.executable, "-c", _SLOW_EXIT_HANDLER_AFTER_A_SHUTDOWN], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3 and done.stdout == "the exit handler ran\n", done


def test_without_a_launcher_a_rank_waits_for_rank_0_s_host_to_resolve_then_fails_in_words(monkeypatch, capsys):
    """A PyTorchJob's pod may start before rank 0's pod name resolves: the rank waits, saying so once; a name
    that never resolves still ends in the one line (at once under a launcher, whose address is set)."""
    import socket

    from hvdtrain.engine.rendezvous import require_resolvable
    from hvdtrain.errors import RendezvousFailed

    answers = iter([socket.gaierror(-2, "Name or service not known")] * 2)

    def getaddrinfo(host, port):
        err = next(answers, None)
        if err is not None:
            raise err
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    require_resolvable("env://job-master-0:29500", 1, wait_seconds=30)
    assert capsys.readouterr().err == ("hvdtrain: rank 1: waiting for rank 0's host 'job-master-0' to resolve (a pod's "
                                       "name does once the pod runs), up to 30 s\n")
    answers = iter([socket.gaierror(-2, "Name or service not known")] * 1000)
    started = time.monotonic()
    with pytest.raises(RendezvousFailed, match="host 'job-master-0' does not resolve \\(Name or service not known\\)"):
        require_resolvable("env://job-master-0:29500", 1, wait_seconds=1.5)
    assert 1.5 <= time.monotonic() - started < 5
    with pytest.raises(RendezvousFailed):
        require_resolvable("env://job-master-0:29500", 1)
    assert capsys.readouterr().err.count("waiting for rank 0's host") == 1


def test_threads_that_this_host_s_ranks_cannot_all_run_are_one_warning(monkeypatch):
    """OMP_NUM_THREADS=8 for 2 ranks on 2 cores halved the speed here, without a word."""
    from hvdtrain.engine import environment

    def host(cpus: int, mine: int, cgroup: int = 0) -> None:
        monkeypatch.setattr(environment.os, "cpu_count", lambda: cpus)
        monkeypatch.setattr(environment, "available_cores", lambda: mine)
        monkeypatch.setattr(environment, "_cgroup_cpus", lambda: set(range(cgroup)))

    host(cpus=2, mine=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert environment.too_many_threads(0, 2) == ("8 threads per process (OMP_NUM_THREADS=8) on 2 cores for 2 "
                                                  "processes: threads wait for cores and every step slows; give "
                                                  "--threads 1")
    assert environment.too_many_threads(1, 2) is None  # --threads wins over OMP_NUM_THREADS
    assert environment.too_many_threads(2, 1) is None
    assert "(--threads 3) on 2 cores for 1 process:" in environment.too_many_threads(3, 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert environment.too_many_threads(0, 2) is None  # the default: each rank's share of the cores
    assert environment.too_many_threads(0, 4) is None  # more ranks than cores: one thread each is the least
    host(cpus=2, mine=1)  # mpirun binds each rank to a core
    assert environment.too_many_threads(0, 2) is None and environment.too_many_threads(1, 2) is None
    assert "(--threads 2) on the 1 core each process is bound to:" in environment.too_many_threads(2, 2)
    host(cpus=64, mine=4, cgroup=4)  # a container's 4 cores on a host of 64, shared by its ranks
    assert environment.too_many_threads(4, 4).endswith("on 4 cores for 4 processes: threads wait for cores and every "
                                                       "step slows; give --threads 1")


def test_horovod_s_wait_replaced_politely_raises_its_errors_as_before_and_is_put_back(monkeypatch):
    """The polite wait polls until the collective is done, then ends in Horovod's own wait, whose error
    Horovod's synchronize raises as before (HorovodInternalError); installed twice it wraps once, and on a
    GPU Horovod's own wait is put back."""
    mpi_ops = pytest.importorskip("horovod.torch.mpi_ops")
    from horovod.common.exceptions import HorovodInternalError

    from hvdtrain.engine.horovod_wait import wait_politely_in

    polls, waits = [], []

    def horovod_torch_poll(handle):
        polls.append(handle)
        return int(len(polls) > 3)

    def horovod_torch_wait_and_clear(handle):
        waits.append(handle)
        raise RuntimeError("the collective failed on rank 1")

    fake = SimpleNamespace(horovod_torch_poll=horovod_torch_poll,
                           horovod_torch_wait_and_clear=horovod_torch_wait_and_clear)
    wait_politely_in(fake, polite=True)
    polite = fake.horovod_torch_wait_and_clear
    wait_politely_in(fake, polite=True)
    assert fake.horovod_torch_wait_and_clear is polite and polite is not horovod_torch_wait_and_clear
    monkeypatch.setattr(mpi_ops, "mpi_lib", fake)
    monkeypatch.setitem(mpi_ops._handle_map, 7, (None, None))
    with pytest.raises(HorovodInternalError, match="the collective failed on rank 1"):
        mpi_ops.synchronize(7)
    assert polls == [7] * 4 and waits == [7]  # polled until done, and Horovod's own wait only then
    wait_politely_in(fake, polite=False)
    assert fake.horovod_torch_wait_and_clear is horovod_torch_wait_and_clear

"""The torch.distributed engine: the only module that calls torch.distributed's process-group API
(named so, not `torch.py`: a submodule called `torch` would shadow the torch package inside
`hvdtrain.engine`).

    torchrun --nproc-per-node 2 hvdtrain fit                   # picked by --engine auto
    mpirun -np 2 hvdtrain fit --engine torch                   # rank and size from Open MPI
    srun -n 2 hvdtrain fit --engine torch                      # rank and size from Slurm
    horovodrun --gloo -np 2 hvdtrain fit --engine torch        # rank and size from horovodrun

No MPI and no Horovod: Gloo on CPUs, NCCL on GPUs, both from PyTorch's own wheels. The
rendezvous is `MASTER_ADDR`/`MASTER_PORT` (torchrun sets them; on one host they default
to 127.0.0.1 and a port derived from the launcher's job or run), or the `tcp://HOST:PORT` in
`HVDTRAIN_INIT_METHOD`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hvdtrain.engine.base import GradientSync, model_tensors
from hvdtrain.engine.watched import WatchedEngine
from hvdtrain.engine.buckets import BucketHooks, buckets, grads_with_flags, write_back
from hvdtrain.engine.environment import env_rendezvous_launched, launcher_facts, torchrun_restarts
from hvdtrain.engine.parent_death import end_with_the_agent
from hvdtrain.engine.rendezvous import RESOLVE_WAIT_SECONDS, could_not_listen, init_method, require_resolvable
from hvdtrain.errors import RendezvousFailed, UserError, message_lines
from hvdtrain.engine.activity import SET_UP_SECONDS, Activity
from hvdtrain.engine.watchdog import Board, StallWatchdog

# What Gloo's TCP transport says when the rank at the other end of a collective has gone.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport/tcp")


def is_collective_failure(err: BaseException) -> bool:
    """A collective failed because another rank failed or left: torch.distributed's own error
    types, or the RuntimeError Gloo raises on a surviving rank. Not this rank's fault to report."""
    if isinstance(err, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in _PEER_GONE) \
        and _raised_in_a_collective(err)


def _raised_in_a_collective(err: BaseException) -> bool:
    """Raised by torch.distributed or this engine, not by a user's data set, model or library whose
    own error speaks of a connection reset by peer (a network file system's, say)."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and any(home in Path(frames[-1].filename).parents for home in _COLLECTIVES_HOMES)


_COLLECTIVES_HOMES = (Path(dist.__file__).parent, Path(__file__).parent)


def _required_facts() -> tuple[int, int, int, int]:
    facts = launcher_facts()
    if facts is None:
        raise UserError("--engine torch needs a launcher: torchrun --nproc-per-node N, mpirun -np N, srun -n N or "
                        "horovodrun -np N")
    return facts


class TorchEngine(WatchedEngine):
    """torch.distributed's process group; build it with `TorchEngine.start()`."""
    name = "torch"

    def __init__(self, device: torch.device, facts: tuple[int, int, int, int], rendezvous: str):
        self.rank, self.size, self.local_rank, self.local_size = facts
        self.device = device
        self.controller = dist.get_backend()
        self.activity = Activity()
        self._gradients: _OverlappedAverage | None = None
        self._watchdog: StallWatchdog | None = None
        self.rendezvous = rendezvous  # where the ranks met, for the start line
        self._scripts_own = False  # the process group is the calling script's, left to it after fit

    @staticmethod
    def local_facts() -> tuple[int, int]:
        facts = _required_facts()
        return facts[2], facts[3]

    @classmethod
    def start(cls, device: torch.device, stall_timeout: int = 300) -> "TorchEngine":
        global _starts, _ours
        end_with_the_agent()
        facts = _required_facts()
        rank, size, local_rank, local_size = facts
        backend = "nccl" if device.type == "cuda" else "gloo"
        if dist.is_initialized() and any(dist.group.WORLD is group for group in (_left, _ours)):
            # a failed fit leaves its group as it is; one this engine started is ended by it, or was left
            raise UserError(f"rank {rank}: an earlier fit or evaluate in this process failed and left its process "
                            "group: start the next one in a launch of its own")
        if dist.is_initialized():
            return cls._in_the_scripts_group(device, facts, backend)
        method = init_method(local_size == size)
        # The process group's own timeout is a last resort: the stall watchdog reports first, naming ranks
        # (in set-up, after SET_UP_SECONDS at least).
        timeout = datetime.timedelta(seconds=max(stall_timeout, SET_UP_SECONDS) + 60 if stall_timeout > 0 else 1800)
        where = f"{method}{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if method == "env://" else method
        if rank != 0:  # rank 0 hosts the rendezvous; the others connect to it
            require_resolvable(where, rank, RESOLVE_WAIT_SECONDS if env_rendezvous_launched() else 0.0)
        try:
            store, _, _ = next(dist.rendezvous(method, rank, size, timeout=timeout))
            if restarts := torchrun_restarts():  # dist: the agent's store keeps the last attempt's addresses
                store = dist.PrefixStore(f"hvdtrain-restart-{restarts}/", store)
            if _starts:
                # dist: a second fit in this process (the Python API) meets in the same store as the first:
                # its own keys, or a rank could read where the other listened the first time and wait there.
                store = dist.PrefixStore(f"hvdtrain-fit-{_starts}/", store)
            _starts += 1
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
            _ours = dist.group.WORLD
        except (RuntimeError, ValueError) as err:  # DistNetworkError, DistStoreError and the like
            raise RendezvousFailed(
                f"rank {rank}: the ranks could not meet at {where}: {message_lines(err)}. The port may be in use "
                "(set MASTER_PORT, or HVDTRAIN_INIT_METHOD=tcp://HOST:PORT, to a free one), or the host may not "
                "be rank 0's or not reachable from this one (MASTER_ADDR)",
                others_wait=rank == 0 and could_not_listen(err)) from err
        engine = cls(device, facts, where)
        engine._store = store
        return engine

    @classmethod
    def _in_the_scripts_group(cls, device: torch.device, facts: tuple[int, int, int, int], backend: str) -> "TorchEngine":
        """The process group of the script that calls fit (its own init_process_group came first): used as it
        is, and left to the script, which goes on using it."""
        rank, size = dist.get_rank(), dist.get_world_size()
        theirs = dict(part.split(":") for part in dist.get_backend_config().split(","))  # cpu:gloo,cuda:nccl
        if (rank, size) != facts[:2]:
            raise UserError(f"rank {facts[0]}: this script's own process group makes it rank {rank} of {size}, and "
                            f"the launcher started it as rank {facts[0]} of {facts[1]}: init_process_group with the "
                            "launcher's RANK and WORLD_SIZE (its defaults do), or leave the process group to hvdtrain")
        if theirs.get(device.type) != backend:
            raise UserError(f"this script's own process group uses {theirs.get(device.type, 'nothing')} on "
                            f"{device.type}, and training there needs {backend}: init_process_group('{backend}'), or "
                            "leave the process group to hvdtrain")
        global _starts
        engine = cls(device, facts, "(the script's own process group)")
        engine.controller, engine._scripts_own = backend, True
        # dist: each fit's activity under keys of its own: a rank not yet at this fit's first collective
        # would otherwise show where it was in the last one
        engine._store = dist.PrefixStore(f"hvdtrain-fit-{_starts}/", dist.distributed_c10d._get_default_store())
        _starts += 1
        return engine

    def _board(self) -> Board | None:
        return _StoreBoard(self._store)

    def describe(self) -> str:
        return f"{super().describe()} rendezvous {self.rendezvous}"

    def is_engine_signal(self, err: BaseException) -> bool:
        return is_collective_failure(err)

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                       sync: GradientSync) -> torch.optim.Optimizer:
        if sync.adasum:
            raise UserError("train.adasum is Horovod's: run under horovodrun or mpirun with --engine horovod, or drop --adasum")
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._gradients = _OverlappedAverage(params, self.size, sync.accumulate, sync.compression)
        return optimizer  # `step` is the optimizer's own: the gradients are averaged before it

    def _synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        self._gradients.wait()
        if self.device.type == "cuda":
            # dist: NCCL's wait() only orders the GPU's streams; the host would block later, in the
            # loss's bool(), outside any collective the stall watchdog can name. Here it is named.
            torch.cuda.current_stream(self.device).synchronize()

    def _skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # `step` never reduces here

    def _segment_collectives(self) -> "_TorchSegments":
        return _TorchSegments(self)

    def _broadcast_parameters(self, model: torch.nn.Module) -> None:
        for tensor in model_tensors(model).values():
            dist.broadcast(tensor, src=0)  # in place: state_dict tensors share storage with the model

    def _broadcast_object(self, obj: Any, name: str) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, device=self._collective_device())
        return holder[0]

    def _allgather_object(self, obj: Any, name: str) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def _gather_object(self, obj: Any, name: str) -> list[Any] | None:
        gathered: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def _allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        reduced = tensor.detach().to(self._collective_device(), copy=True)
        dist.all_reduce(reduced)
        return reduced.to(tensor.device)

    def _send_to_root(self, obj: Any, sender: int, name: str) -> Any:
        if sender == 0 or self.rank not in (0, sender):
            return obj if self.rank == 0 else None
        holder = [obj]
        if self.rank == sender:
            dist.send_object_list(holder, dst=0, device=self._collective_device())
            return None
        dist.recv_object_list(holder, src=sender, device=self._collective_device())
        return holder[0]

    def _barrier(self) -> None:
        dist.barrier()

    def _shutdown(self, finished: bool) -> None:
        global _leave_at_once, _left
        if not finished:  # the ranks may be out of step in it: a next fit in this process is refused
            _left = dist.group.WORLD
        if not dist.is_initialized() or self._scripts_own:
            return
        # The command leaves with os._exit (cli/leaving.py) either way: the interpreter's own teardown of
        # the C++ side (the store client, Gloo's contexts) ended in terminate now and then (SIGABRT,
        # exit 134 after a finished run; about 1 run in 15 under mpirun on a busy host).
        _leave_at_once = True
        if not finished:
            # dist: on the way out of a failure the others may be gone (rank 0 hosts the store), and
            # tearing the group down then ended in terminate too. The group is left as it is.
            return
        # dist: rank 0 hosts the store; leaving before the others are done with it (their stall
        # watchdogs publish there) left a rank's thread in a store call at exit: SIGABRT.
        dist.barrier()
        dist.destroy_process_group()

    def _collective_device(self) -> torch.device:
        return self.device if self.controller == "nccl" else torch.device("cpu")


class _StoreBoard:
    """Every rank's latest Activity, for the stall watchdog, in the process group's own store."""

    def __init__(self, store: dist.Store):
        self.store = dist.PrefixStore("hvdtrain-activity/", store)
        self.gone = False
        """The store's host (rank 0, or torchrun's agent) is gone: its client never connects again, and
        each try printed a C++ traceback."""

    def publish(self, rank: int, activity: Activity) -> None:
        if self.gone:
            return
        try:
            self.store.set(str(rank), activity.to_json())
        except dist.DistNetworkError:  # its connection broke (a timeout passes: the next pass tries again)
            self.gone = True

    def read(self, rank: int) -> Activity | None:
        if self.gone:
            return None
        try:
            if not self.store.check([str(rank)]):  # never published: get would wait for it
                return None
            return Activity.from_json(self.store.get(str(rank)))
        except RuntimeError:  # the store is gone (rank 0's host hosts it)
            return None


def _reduce_scatter_single() -> Callable[..., Any]:
    """torch 2.13's name; earlier releases (a GPU image's torch 2.11) have only the name it deprecates."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_single() -> Callable[..., Any]:
    """As _reduce_scatter_single: all_gather_single from torch 2.13, all_gather_into_tensor before."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _TorchSegments:
    """Collectives over equal segments on torch.distributed (Gloo or NCCL)."""

    def __init__(self, engine: TorchEngine):
        self.rank, self.size, self.allreduce_sum = engine.rank, engine.size, engine.allreduce_sum

    def reduce_scatter(self, flat: torch.Tensor, name: str) -> Any:
        received = flat.new_empty(flat.numel() // self.size)
        return _reduce_scatter_single()(received, flat, async_op=True), received

    def all_gather(self, segment: torch.Tensor, name: str) -> Any:
        gathered = segment.new_empty(segment.numel() * self.size)
        return _all_gather_single()(gathered, segment, async_op=True), gathered

    def all_to_all(self, flat: torch.Tensor, name: str) -> Any:
        received = torch.empty_like(flat)
        return dist.all_to_all_single(received, flat, async_op=True), received

    def wait(self, handle: Any) -> torch.Tensor:
        work, result = handle
        work.wait()
        return result


class _OverlappedAverage:
    """Averages gradients over ranks while backward still runs (`buckets.BucketHooks`): one
    asynchronous allreduce per bucket. `wait` starts whatever is left, waits for all and writes the
    averages back."""

    def __init__(self, params: list[torch.nn.Parameter], size: int, accumulate: int, compression: str):
        self.size, self.fp16 = size, compression == "fp16"
        self.hooks = BucketHooks(buckets(list(reversed(params))), accumulate, self._start)
        self.started: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (work, wire, flat) per started bucket

    def _start(self, index: int) -> None:
        grads, used = grads_with_flags(self.hooks.buckets[index])
        flat = torch.cat([*grads, used])
        # dist: fp16 on the wire divides before the sum (as DDP does): a sum of gradients each below
        # fp16's limit can overflow where their average would not.
        wire = flat.div(self.size).half() if self.fp16 and flat.is_floating_point() else flat
        self.started.append((dist.all_reduce(wire, async_op=True), wire, flat))  # dist: the sum over ranks

    def wait(self) -> None:
        self.hooks.start_rest()
        for bucket, (work, wire, flat) in zip(self.hooks.buckets, self.started):
            work.wait()
            if wire is not flat:
                flat = wire.to(flat.dtype)  # the average already
            else:
                flat.div_(self.size)  # dist: ... over the world size: the average
            write_back(bucket, flat)
        self.started.clear()
        self.hooks.reset()


_leave_at_once = False  # the engine has shut down: the process ends at once (cli/leaving.py)
_starts = 0  # process groups this process has started: each fit of the Python API starts one
_left: Any = None  # the process group a failed fit left as it was (its own, or the calling script's)
_ours: Any = None  # the process group this engine last started


def leaves_at_once() -> bool:
    """Whether the engine has shut down, so that the process should end past the interpreter's teardown
    (hvdtrain.cli.leaving.leave_at_once)."""
    return _leave_at_once

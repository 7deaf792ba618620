"""The Horovod engine: the only module that imports `horovod.torch`."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Callable

import torch

from hvdtrain.engine.base import ElasticState, GradientSync, T, model_tensors
from hvdtrain.engine.buckets import host_values
from hvdtrain.engine.horovod_start import MPI_SETTINGS, mpi_controls, set_ours, start_mpi
from hvdtrain.engine.horovod_wait import wait_politely_in
from hvdtrain.engine.horovod_wire import OnTheWire, broadcastable, copyable, summable
from hvdtrain.engine.watched import WatchedEngine
from hvdtrain.errors import UserError
from hvdtrain.engine.activity import SET_UP_SECONDS, Activity
from hvdtrain.engine.watchdog import Board, KeyValueBoard, StallWatchdog

try:
    import horovod.torch as hvd
    from horovod.common.elastic import ObjectState
    from horovod.torch import mpi_ops as _horovod_ops
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
except ImportError as err:  # reported when a launcher asks for Horovod, not at import
    hvd = None
    HorovodInternalError = HostsUpdatedInterrupt = None
    ObjectState = object
    _import_error: ImportError | None = err
else:
    _import_error = None


_ours_running = False  # hvdtrain's own hvd.init() started Horovod, and no shutdown has followed
_scripts_own = False  # at the last start, Horovod was running already, started by the calling script


def horovod_available() -> bool:
    return hvd is not None


def is_collective_failure(err: BaseException) -> bool:
    """Horovod stopped: another rank failed or left, or a stall ran past its timeout. Not a data-loader worker
    of this rank's that died (torch's SIGCHLD handler raises inside Horovod's wait, which raises it again)."""
    inner = getattr(err, "__context__", None)
    return (HorovodInternalError is not None and isinstance(err, HorovodInternalError)
            and not (isinstance(inner, RuntimeError) and str(inner).startswith("DataLoader worker (")))


class HorovodEngine(WatchedEngine):
    """Wraps an initialised Horovod; build it with `HorovodEngine.start()`."""
    name = "horovod"

    def __init__(self, device: torch.device, controller: str):
        self.device = device
        self.controller = controller
        self.activity = Activity()
        self._watchdog: StallWatchdog | None = None
        self._adasum = False
        self.scripts_own = _scripts_own  # Horovod is the calling script's: left running after fit

    # Read from Horovod each time: in elastic training they change when processes come and go.
    rank = property(lambda self: hvd.rank())
    local_rank = property(lambda self: hvd.local_rank())
    size = property(lambda self: hvd.size())
    local_size = property(lambda self: hvd.local_size())

    @staticmethod
    def init(stall_timeout: int = 300, timeline: bool = False, keep_mpi: bool = False) -> None:
        """Joins the job the launcher started (horovodrun or mpirun); `timeline` lets the run
        record Horovod's timeline into a file chosen later (its run directory). `keep_mpi`: MPI
        outlives this engine, for another one later in the process."""
        if hvd is None:
            raise UserError(
                f"started by a launcher but Horovod does not import ({_import_error}): "
                "run launch/install.sh, or run hvdtrain fit alone without horovodrun/mpirun"
            )
        global _scripts_own, _ours_running
        _scripts_own = hvd.is_initialized() and not _ours_running  # the script's own hvd.init() came first
        if _scripts_own:
            return  # its settings and its MPI; it goes on using Horovod after fit, which leaves it running
        longest = int(max(stall_timeout, SET_UP_SECONDS))
        # dist: hvdtrain's watchdog reports a stall first, with every rank's stack; Horovod's stall
        # inspector is the last resort behind it (a rank that could not reach rank 0's report port).
        # Horovod reads these at init; a user's own settings win. Set-up waits longer (SET_UP_SECONDS).
        set_ours("HOROVOD_STALL_CHECK_TIME_SECONDS", str(longest + 15) if stall_timeout > 0 else None)
        set_ours("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(longest + 30) if stall_timeout > 0 else None)
        for name, value in MPI_SETTINGS.items():  # read by MPI_Init; a user's own settings win
            os.environ.setdefault(name, value)
        # Read at init: start_timeline works only then.
        set_ours("HOROVOD_TIMELINE", "DYNAMIC" if timeline else None, over_theirs=timeline)
        if hvd.mpi_built() and mpi_controls():
            start_mpi(keep_mpi)
        hvd.init()
        _ours_running = True

    @staticmethod
    def local_facts() -> tuple[int, int]:
        """(local_rank, local_size), valid after `init`."""
        return hvd.local_rank(), hvd.local_size()

    @classmethod
    def start(cls, device: torch.device, stall_timeout: int = 0) -> "HorovodEngine":
        wait_politely_in(_horovod_ops.mpi_lib, polite=device.type == "cpu")  # a script's own Horovod too
        controller = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "unknown"
        return cls(device, controller)

    def _board(self) -> Board | None:
        return KeyValueBoard.from_environment() if self.controller == "gloo" else None

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                       sync: GradientSync) -> torch.optim.Optimizer:
        if sync.adasum and not hvd.mpi_enabled():
            raise UserError("train.adasum needs the MPI controller: launch with horovodrun --mpi or mpirun, or drop --adasum")
        compression = hvd.Compression.fp16 if sync.compression == "fp16" else hvd.Compression.none
        self._adasum = sync.adasum
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=OnTheWire(compression),
            backward_passes_per_step=sync.accumulate,
            op=hvd.Adasum if sync.adasum else hvd.Average,
            # dist: fp16 on the wire divides by the world size before the sum, not after it: a sum of
            # gradients each below fp16's limit (65504) can overflow where their average would not.
            gradient_predivide_factor=float(hvd.size()) if sync.compression == "fp16" and not sync.adasum else 1.0,
        )

    def _updates_in_step(self) -> bool:
        return self._adasum  # Horovod's Adasum optimizer combines parameter deltas inside step()

    def _synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        # dist: whether each rank computed each gradient, summed in the same fused cycle as the
        # gradients: Horovod fills a missing one with zeros, and one that no rank computed keeps none
        # (as with DDP), so momentum and weight decay leave that parameter alone.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        used = host_values([float(p.grad is not None) for p in params], torch.float32, params[0].device)
        handle = hvd.allreduce_async(used, op=hvd.Sum, name="hvdtrain.gradients_used")
        optimizer.synchronize()
        for param, users in zip(params, hvd.synchronize(handle).tolist()):
            if users == 0:
                param.grad = None

    def is_engine_signal(self, err: BaseException) -> bool:
        return is_collective_failure(err) or isinstance(err, HostsUpdatedInterrupt)

    def _skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        return optimizer.skip_synchronize()

    def _segment_collectives(self) -> "_HorovodSegments":
        return _HorovodSegments(self)

    def _broadcast_parameters(self, model: torch.nn.Module) -> None:
        # Horovod sends contiguous tensors only; a channels-last model's 4-D weights are not: each of those
        # goes on its own, as a contiguous copy (one at a time, not a second copy of the model).
        state = {name: broadcastable(tensor) for name, tensor in model_tensors(model).items()}
        hvd.broadcast_parameters({name: t for name, t in state.items() if t.is_contiguous()}, root_rank=0)
        for name, tensor in state.items():
            if not tensor.is_contiguous():
                tensor.copy_(hvd.broadcast(tensor.contiguous(), root_rank=0, name=f"hvdtrain.parameter.{name}"))

    def _broadcast_object(self, obj: Any, name: str) -> Any:
        return hvd.broadcast_object(obj, root_rank=0, name=name)

    def _allgather_object(self, obj: Any, name: str) -> list[Any]:
        return hvd.allgather_object(obj, name=name)

    def _gather_object(self, obj: Any, name: str) -> list[Any] | None:
        # Horovod has no gather: one broadcast per rank, each kept by rank 0 only, so another rank
        # holds its own object and one other at a time, never all of them.
        gathered = []
        for root in range(self.size):
            received = hvd.broadcast_object(obj if root == self.rank else None, root_rank=root, name=f"{name}.{root}")
            if self.is_root:
                gathered.append(received)
        return gathered if self.is_root else None

    def _allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.allreduce(tensor, name=name, op=hvd.Sum)

    def _send_to_root(self, obj: Any, sender: int, name: str) -> Any:
        # Horovod has no point-to-point send: a broadcast from `sender`, kept by rank 0 only.
        received = hvd.broadcast_object(obj if self.rank == sender else None, root_rank=sender, name=name)
        return received if self.is_root else None

    def require_elastic(self) -> None:
        if os.environ.get("HOROVOD_ELASTIC") != "1":  # set by horovodrun's elastic driver
            super().require_elastic()

    def elastic_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      before_sync: Callable[[], None], **objects: Any) -> ElasticState:
        return _ElasticState(self, model, optimizer, before_sync, **objects)

    def run_elastic(self, train: Callable[[ElasticState], T], state: ElasticState) -> T:
        return hvd.elastic.run(train)(state)

    def require_timeline(self) -> None:
        if self.scripts_own and "HOROVOD_TIMELINE" not in os.environ:
            raise UserError("--horovod-timeline needs HOROVOD_TIMELINE=DYNAMIC when Horovod starts, and this script "
                            "started Horovod itself (hvd.init()) without it: set it before hvd.init(), or drop "
                            "--horovod-timeline")

    def start_timeline(self, path: Path) -> None:
        hvd.start_timeline(str(path), mark_cycles=False)  # dist: the coordinator (rank 0) writes it

    def stop_timeline(self) -> None:
        hvd.stop_timeline()

    def _barrier(self) -> None:
        hvd.barrier()

    def _shutdown(self, finished: bool) -> None:
        global _ours_running
        if not self.scripts_own:
            hvd.shutdown()
            _ours_running = False


class _HorovodSegments:
    """Collectives over equal segments on Horovod (MPI, Gloo or NCCL): Horovod's split of the first
    dimension is the partition's."""

    def __init__(self, engine: HorovodEngine):
        self.rank, self.size, self.allreduce_sum = engine.rank, engine.size, engine.allreduce_sum

    # Each handle comes with what makes its result the tensor's dtype again (horovod_wire: bf16, complex).
    def reduce_scatter(self, flat: torch.Tensor, name: str) -> Any:
        sent, back = summable(flat)
        return hvd.reducescatter_async(sent, name=name, op=hvd.Sum), back

    def all_gather(self, segment: torch.Tensor, name: str) -> Any:
        sent, back = copyable(segment)
        return hvd.allgather_async(sent, name=name), back

    def all_to_all(self, flat: torch.Tensor, name: str) -> Any:
        sent, back = copyable(flat)
        return hvd.alltoall_async(sent, name=name), back

    def wait(self, handle: Any) -> torch.Tensor:
        handle, back = handle
        result = hvd.synchronize(handle)
        return back(result[0] if isinstance(result, tuple) else result)  # an all-to-all's: (received, splits)


class _ElasticState(ObjectState):
    """Horovod's elastic object state, plus the model and optimizer.

    Not Horovod's TorchState: its optimizer sync takes a dummy step on processes with
    empty optimizer state, which moves their weights (weight decay) away from rank 0's.
    Here the optimizer state is simply copied from rank 0.
    """

    def __init__(self, engine: HorovodEngine, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 before_sync: Callable[[], None], **objects: Any):
        self._engine, self._model, self._optimizer = engine, model, optimizer
        self._before_sync = before_sync
        super().__init__(bcast_object=lambda obj: engine.broadcast_object(obj, "elastic.state"),
                         get_rank=hvd.rank, **objects)
        self._save_tensors()

    def _save_tensors(self) -> None:
        self._saved_model = copy.deepcopy(self._model.state_dict())
        self._saved_optimizer = copy.deepcopy(self._optimizer.state_dict())

    def save(self) -> None:
        self._save_tensors()
        super().save()

    def restore(self) -> None:
        self._model.load_state_dict(self._saved_model)
        self._optimizer.load_state_dict(self._saved_optimizer)
        _drop_pending_allreduces(self._optimizer)
        super().restore()

    def sync(self) -> None:
        # dist: a new process's first collectives: the same sequence as everyone else's here.
        self._before_sync()
        self._engine.broadcast_parameters(self._model)
        self._engine.broadcast_optimizer_state(self._optimizer)
        super().sync()
        self._save_tensors()


def _drop_pending_allreduces(optimizer: torch.optim.Optimizer) -> None:
    """Forgets the allreduces of a step that a lost process interrupted.

    Horovod's DistributedOptimizer keeps them in private fields and would otherwise
    refuse the next backward pass ("computed more than backward_passes_per_step times").
    """
    optimizer._handles.clear()
    for param in optimizer._allreduce_delay:
        optimizer._allreduce_delay[param] = optimizer.backward_passes_per_step
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None

"""The Horovod engine: the only module that imports `horovod.torch`."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from hvdtrain.engine.base import Engine, GradientSync
from hvdtrain.errors import UserError

try:
    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError
except ImportError as err:  # reported when a launcher asks for Horovod, not at import
    hvd = None
    HorovodInternalError = None
    _import_error: ImportError | None = err
else:
    _import_error = None


def horovod_available() -> bool:
    return hvd is not None


def is_collective_failure(err: BaseException) -> bool:
    """Horovod stopped: another rank failed or left, or a stall ran past its timeout."""
    return HorovodInternalError is not None and isinstance(err, HorovodInternalError)


class HorovodEngine(Engine):
    """Wraps an initialised Horovod; build it with `HorovodEngine.start()`."""

    def __init__(self, device: torch.device, controller: str):
        self.rank, self.local_rank = hvd.rank(), hvd.local_rank()
        self.size, self.local_size = hvd.size(), hvd.local_size()
        self.device = device
        self.controller = controller

    @staticmethod
    def init(stall_timeout: int = 300) -> None:
        """Joins the job the launcher started (horovodrun or mpirun)."""
        if hvd is None:
            raise UserError(
                f"started by a launcher but Horovod does not import ({_import_error}): "
                "run launch/install.sh, or run hvdtrain fit alone without horovodrun/mpirun"
            )
        if stall_timeout > 0:
            # dist: a collective some ranks never join becomes an error naming them, not a hang.
            # Horovod reads these at init; a user's own settings win.
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, min(60, stall_timeout // 2))))
            os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(stall_timeout))
        hvd.init()

    @staticmethod
    def local_facts() -> tuple[int, int]:
        """(local_rank, local_size), valid after `init`."""
        return hvd.local_rank(), hvd.local_size()

    @classmethod
    def start(cls, device: torch.device) -> "HorovodEngine":
        controller = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "unknown"
        return cls(device, controller)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                       sync: GradientSync) -> torch.optim.Optimizer:
        if sync.adasum and not hvd.mpi_enabled():
            raise UserError("train.adasum needs the MPI controller: launch with horovodrun --mpi or mpirun, or drop --adasum")
        compression = hvd.Compression.fp16 if sync.compression == "fp16" else hvd.Compression.none
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=compression,
            backward_passes_per_step=sync.accumulate,
            op=hvd.Adasum if sync.adasum else hvd.Average,
        )

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.synchronize()

    def skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        return optimizer.skip_synchronize()

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return hvd.broadcast_object(obj, root_rank=0, name=name)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return hvd.allgather_object(obj, name=name)

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.allreduce(tensor, name=name, op=hvd.Sum)

    def barrier(self) -> None:
        hvd.barrier()

    def shutdown(self) -> None:
        hvd.shutdown()

"""The torch.distributed engine: the only module that calls torch.distributed's process-group API
(named so, not `torch.py`: a submodule called `torch` would shadow the torch package inside
`hvdtrain.engine`).

    torchrun --nproc-per-node 2 hvdtrain fit                   # picked by --engine auto
    mpirun -np 2 hvdtrain fit --engine torch                   # rank and size from Open MPI
    srun -n 2 hvdtrain fit --engine torch                      # rank and size from Slurm

No MPI and no Horovod: Gloo on CPUs, NCCL on GPUs, both from PyTorch's own wheels. The
rendezvous is `MASTER_ADDR`/`MASTER_PORT` (torchrun sets them; on one host they default
to 127.0.0.1 and a port derived from the launcher's job id).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from hvdtrain.engine.base import Engine, GradientSync
from hvdtrain.errors import UserError

# (rank, world size, local rank, local size) as each launcher names them.
_LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
# Gradients are reduced in buckets of about this many bytes: one collective per bucket.
BUCKET_BYTES = 25 << 20


def torchrun_launched() -> bool:
    """torchrun (torch.distributed.run) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launcher_facts() -> tuple[int, int, int, int] | None:
    """(rank, size, local rank, local size) from the launcher's environment; None without one."""
    for names in _LAUNCHER_VARIABLES:
        if all(name in os.environ for name in names[:2]):
            rank, size = int(os.environ[names[0]]), int(os.environ[names[1]])
            local_rank = int(os.environ.get(names[2], rank))
            local_size = int(os.environ.get(names[3], str(size)).split("(")[0])  # Slurm may write "2(x3)"
            return rank, size, local_rank, local_size
    return None


def _required_facts() -> tuple[int, int, int, int]:
    facts = launcher_facts()
    if facts is None:
        raise UserError("--engine torch needs a launcher: torchrun --nproc-per-node N, mpirun -np N or srun -n N")
    return facts


class TorchEngine(Engine):
    """torch.distributed's process group; build it with `TorchEngine.start()`."""

    def __init__(self, device: torch.device, facts: tuple[int, int, int, int]):
        self.rank, self.size, self.local_rank, self.local_size = facts
        self.device = device
        self.controller = dist.get_backend()
        self._compression = "none"

    @staticmethod
    def local_facts() -> tuple[int, int]:
        facts = _required_facts()
        return facts[2], facts[3]

    @classmethod
    def start(cls, device: torch.device, stall_timeout: int = 300) -> "TorchEngine":
        facts = _required_facts()
        rank, size, local_rank, local_size = facts
        if "MASTER_ADDR" not in os.environ:
            if local_size != size:
                raise UserError("--engine torch across hosts needs MASTER_ADDR and MASTER_PORT (rank 0's host and a "
                                "free port) in every process's environment, e.g. mpirun -x MASTER_ADDR -x MASTER_PORT")
            os.environ["MASTER_ADDR"] = "127.0.0.1"  # dist: every rank on this host
        os.environ.setdefault("MASTER_PORT", str(_port_for_job()))
        backend = "nccl" if device.type == "cuda" else "gloo"
        # dist: a collective that some rank never joins fails after the stall timeout instead of hanging.
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=stall_timeout or 1800))
        return cls(device, facts)

    def is_engine_signal(self, err: BaseException) -> bool:
        return isinstance(err, (dist.DistBackendError, dist.DistNetworkError))

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                       sync: GradientSync) -> torch.optim.Optimizer:
        if sync.adasum:
            raise UserError("train.adasum is Horovod's: run under horovodrun or mpirun with --engine horovod, or drop --adasum")
        self._compression = sync.compression
        return optimizer  # gradients are averaged in `synchronize`, once per optimizer step

    def synchronize(self, optimizer: torch.optim.Optimizer) -> bool:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            wire = flat.half() if self._compression == "fp16" and flat.is_floating_point() else flat
            dist.all_reduce(wire)  # dist: the sum over ranks ...
            flat = wire.to(flat.dtype).div_(self.size)  # ... over the world size: the average
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        return True

    def skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # `step` never reduces here

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)  # in place: state_dict tensors share storage with the model

    def broadcast_object(self, obj: Any, name: str) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, device=self._collective_device())
        return holder[0]

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        reduced = tensor.detach().to(self._collective_device(), copy=True)
        dist.all_reduce(reduced)
        return reduced.to(tensor.device)

    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _collective_device(self) -> torch.device:
        return self.device if self.controller == "nccl" else torch.device("cpu")


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, about BUCKET_BYTES each."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        last = buckets[-1] if buckets else None
        if (last is None or size + grad.numel() * grad.element_size() > BUCKET_BYTES
                or grad.dtype != last[0].dtype or grad.device != last[0].device):
            buckets.append([grad])
            size = grad.numel() * grad.element_size()
        else:
            last.append(grad)
            size += grad.numel() * grad.element_size()
    return buckets


def _port_for_job() -> int:
    """The same port on every rank of one job, different across jobs (Open MPI's or Slurm's job id)."""
    job = os.environ.get("OMPI_MCA_ess_base_jobid") or os.environ.get("SLURM_JOB_ID") or "0"
    digits = "".join(c for c in job if c.isdigit()) or "0"
    return 29500 + int(digits) % 20000

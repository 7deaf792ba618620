"""The boundary between the training loop and the distributed engine.

The loop, the trainer and the metrics speak only to an `Engine`. `HorovodEngine` is
the one module that imports `horovod.torch`; `LocalEngine` is one process whose
collectives are identities, so everything above runs and is tested without Horovod.
`engine.watched.WatchedEngine` is what the engines of several processes share.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, TypeVar

import torch

from hvdtrain.engine.activity import MADE_IN_TURN
from hvdtrain.engine.powersgd import PowerSGD
from hvdtrain.engine.sharded import ShardedGradients
from hvdtrain.errors import UserError, note_where_the_job_stood, where_the_job_stood

T = TypeVar("T")


@dataclass(frozen=True)
class GradientSync:
    """How gradients are combined across processes."""

    accumulate: int = 1
    """Backward passes per optimizer step."""
    compression: str = "none"
    """`none`, `fp16` or `bf16` on the wire, or `powersgd` (low-rank factors)."""
    adasum: bool = False
    """Adasum instead of averaging."""
    shard: bool = False
    """Optimizer state sharded across ranks (`hvdtrain.engine.sharded`): gradients reduce-scattered,
    each rank steps its share, parameters all-gathered."""
    powersgd_rank: int = 4
    """With `powersgd` compression: the rank of each matrix's factors."""
    seed: int = 0
    """PowerSGD's first factors are drawn from it (the same on every rank)."""
    loss_scale: Callable[[], float] = lambda: 1.0
    """The factor the gradients carry now (a gradient scaler's): PowerSGD keeps its errors unscaled."""


class Engine(ABC):
    """Rank facts and the collectives the trainer needs."""

    rank: int
    local_rank: int
    size: int
    local_size: int
    device: torch.device
    name: str  # "horovod", "torch" or "local"
    controller: str  # "gloo", "mpi", "nccl" or "local"
    gradient_shards: ShardedGradients | None = None
    """Set when the optimizer state is sharded: each rank's gradients are its share's only."""
    powersgd: PowerSGD | None = None
    """Set with PowerSGD: its error buffers (each rank's own) and factors are training state."""

    @property
    def is_root(self) -> bool:
        """Rank 0 alone prints progress and writes shared files."""
        return self.rank == 0

    def describe(self) -> str:
        """The start line every rank logs."""
        return (
            f"rank {self.rank}/{self.size} local_rank {self.local_rank}/{self.local_size} "
            f"device {self.device} controller {self.controller} threads {torch.get_num_threads()}"
        )

    def at(self, where: str) -> None:
        """Where the training loop is now; a stall report names it."""

    def doing(self, phase: str) -> str:
        """What the training thread does now (data loading, forward, ...): a stall report names it and the
        straggler check adds up its time. Returns the phase it left."""
        return ""

    def phase_seconds(self) -> tuple[float, float, float, float]:
        """(data loading, computing a step, waiting in collectives, all) seconds of this rank so far: the
        straggler check's clock."""
        return 0.0, 0.0, 0.0, 0.0

    def report_into(self, run_dir: Path) -> None:
        """Rank 0: stall reports and `hvdtrain where` keep every rank's stacks in `run_dir`."""

    def is_engine_signal(self, err: BaseException) -> bool:
        """Whether `err` is the engine's own: its collectives stopped (another rank failed or
        left), or, in elastic training, the set of processes changed."""
        return False

    @abstractmethod
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                       sync: GradientSync) -> torch.optim.Optimizer:
        """An optimizer whose gradients are combined across processes before `step`."""

    @abstractmethod
    def synchronize(self, optimizer: torch.optim.Optimizer) -> bool:
        """Waits for the gradient allreduce; after it, gradients are global (clip or unscale here).

        Returns False when the optimizer combines parameter updates inside `step` instead
        (Adasum): the gradients stay each rank's own and `step` must be called as it is."""

    @abstractmethod
    def skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        """Context in which `optimizer.step()` does not allreduce again (after `synchronize`)."""

    @abstractmethod
    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Copies rank 0's parameters and buffers to every rank."""

    @abstractmethod
    def broadcast_object(self, obj: Any, name: str) -> Any:
        """Rank 0's picklable object, on every rank."""

    @abstractmethod
    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""

    @abstractmethod
    def gather_object(self, obj: Any, name: str) -> list[Any] | None:
        """Every rank's object, in rank order, on rank 0 (None elsewhere): what only rank 0 needs
        does not take memory on the others (predictions)."""

    @abstractmethod
    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Element-wise sum over ranks (metrics: sums and counts, so means are exact)."""

    @abstractmethod
    def send_to_root(self, obj: Any, sender: int, name: str) -> Any:
        """Rank `sender`'s picklable object, on rank 0 (None elsewhere); every rank calls it. One rank's
        at a time, so rank 0 can write each before it takes the next (a sharded optimizer's checkpoint)."""

    @abstractmethod
    def barrier(self) -> None:
        """Returns once every rank has arrived."""

    @abstractmethod
    def shutdown(self, finished: bool = False) -> None:
        """Releases the engine; collectives are invalid afterwards. `finished`: every rank got here
        after its work succeeded (so a last collective may still be run), not on the way out of a failure."""

    def broadcast_optimizer_state(self, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any] | None = None) -> None:
        """Copies rank 0's optimizer state (as after a resume; `state`: the whole of it, where rank 0's
        optimizer holds only its share) to every rank; with sharding each keeps its share only."""
        if self.size == 1:
            return
        if self.is_root and state is None:
            state = optimizer.state_dict()
        shards = self.gradient_shards
        if shards is not None:  # dist: each rank's share alone, in turn: no rank but 0 holds more than one at once
            for rank in range(1, self.size):
                share = on_cpu(shards.owned_state(optimizer, state, rank)) if self.is_root else None
                share = self.broadcast_object(share, f"optimizer_share.{rank}")
                if self.rank == rank:
                    optimizer.load_state_dict(share)
                del share
            return
        # dist: sent from the host: pickled CUDA tensors would be unpickled onto cuda:0 on every rank (a
        # context and a copy there per rank); load_state_dict moves them to each rank's own device.
        state = self.broadcast_object(on_cpu(state) if self.is_root else None, "optimizer_state")
        if not self.is_root:
            optimizer.load_state_dict(self.own_share(optimizer, state))

    def broadcast_powersgd(self, saved: dict[str, Any] | None) -> None:
        """PowerSGD's state from rank 0's checkpoint (`saved`: rank 0's, None where it starts afresh): each
        rank gets the factors and its own errors, one rank at a time."""
        if self.powersgd is None:
            return
        if not self.broadcast_object(saved is not None if self.is_root else None, "powersgd_resumed"):
            return
        for rank in range(self.size):
            part = {"factors": saved["factors"], "errors": saved["errors"][rank]} if self.is_root else None
            if rank:
                part = self.broadcast_object(part, f"powersgd.{rank}")  # dist
            if self.rank == rank:
                self.powersgd.load_state_dict(part)
            del part

    def own_share(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict as this rank's optimizer keeps it: all of it, or its share when sharded."""
        return state if self.gradient_shards is None else self.gradient_shards.owned_state(optimizer, state)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        return bool(self.allreduce_sum(torch.tensor([float(flag)]), "any_rank")[0] > 0) if self.size > 1 else flag

    def made_in_turn(self, make: Callable[[], T]) -> T | None:
        """`make()` on rank 0, then on each other host's first rank, every rank waiting out each turn (in
        `agree`, so a failure there stops every rank): what `make` downloads or caches is made once (into a
        folder every host shares, by rank 0; onto a host's own disk, by its first rank), not by every rank
        at once over the same files. What it made on those ranks; None on the rest and in one process,
        which make theirs after, in an `agree` of their own."""
        made = None
        for turn, mine in enumerate((self.rank == 0, self.local_rank == 0 and self.rank != 0)):
            with self.agree(f"{MADE_IN_TURN}.{turn}"):
                if mine and self.size > 1:
                    made = make()
        return made

    @contextlib.contextmanager
    def agree(self, phase: str) -> Iterator[None]:
        """Runs a set-up phase on every rank and fails all ranks together if any fails.

        Set-up errors can differ by rank (a file missing on one host); without this
        the healthy ranks would wait forever in their first collective.
        """
        error: BaseException | None = None
        try:
            yield
        except Exception as err:  # noqa: BLE001 - re-raised by settle on every rank
            error = err
        self.settle(phase, error)

    def settle(self, phase: str, error: BaseException | None) -> None:
        """Every rank says how its part of `phase` went; raises on all if any failed."""
        if self.size > 1:
            try:
                reports = self.allgather_object(None if error is None else _report(error), f"agree.{phase}")
            except Exception as broken:  # where this rank's own error had noted the job stood, if it had
                if error is not None and where_the_job_stood(error):
                    note_where_the_job_stood(broken, *where_the_job_stood(error))
                raise
            failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
            if failed and error is None:
                rank, (kind, message) = failed[0]
                raise RankFailed(rank, kind, message)
        if error is not None:
            raise error

    # Horovod's timeline: the engine's own record of every collective.
    def require_timeline(self) -> None:
        """Raises unless this engine can record a timeline."""
        raise UserError("--horovod-timeline records Horovod's collectives, and this process runs without Horovod: "
                        "start it with horovodrun or mpirun (-np 1 works too)")

    def start_timeline(self, path: Path) -> None:
        """Starts recording into `path` (rank 0 writes it); call on every rank."""
        self.require_timeline()

    def stop_timeline(self) -> None:
        """Stops recording and closes the file."""

    # Elastic training: only Horovod's Gloo launcher can replace processes.
    def require_elastic(self) -> None:
        """Raises unless this process was started for elastic training."""
        raise UserError("--elastic needs processes started by horovodrun in elastic mode: horovodrun --gloo "
                        "-np N --min-np M --host-discovery-script launch/discover-hosts.sh hvdtrain fit --elastic")

    def elastic_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      before_sync: Callable[[], None], **objects: Any) -> "ElasticState":
        """State that survives a change of processes (see `run_elastic`)."""
        raise NotImplementedError

    def run_elastic(self, train: Callable[["ElasticState"], T], state: "ElasticState") -> T:
        """Calls `train(state)` until it returns, again after every change of processes.

        Before each call the state is copied from rank 0 (a new process gets it so), and
        after a lost process it is rolled back to its last `commit`; rank and size may
        differ from one call to the next.
        """
        raise NotImplementedError


class ElasticState(Protocol):
    """Model, optimizer and named values, kept in memory at each `commit`."""

    def commit(self) -> None:
        """Keeps the current values; also where a change of processes is noticed (it raises)."""

    def __getattr__(self, name: str) -> Any: ...


class RankFailed(Exception):
    """Another rank failed during a phase that all ranks run together."""

    def __init__(self, rank: int, kind: str, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.kind, self.message = rank, kind, message


EXTRA_STATE = "_extra_state"
"""The state-dict key (after a module's prefix) of a module's get_extra_state: any object, a tensor too."""


def is_extra_state(key: str) -> bool:
    return key == EXTRA_STATE or key.endswith(f".{EXTRA_STATE}")


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name, in state-dict order: its state less any extra state
    (a module's get_extra_state: a vocabulary, a version)."""
    return {name: value for name, value in model.state_dict().items() if not is_extra_state(name)}


def extra_state(model: torch.nn.Module) -> dict[str, Any]:
    """The modules' extra state (get_extra_state) by state-dict key."""
    return {name: value for name, value in model.state_dict().items() if is_extra_state(name)}


def set_extra_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Gives each module its extra state from `state` (extra_state's keys), through its set_extra_state."""
    for prefix, module in model.named_modules():
        key = f"{prefix}.{EXTRA_STATE}" if prefix else EXTRA_STATE
        if key in state:
            module.set_extra_state(state[key])


def on_cpu(value: Any) -> Any:
    """`value` (a state dict: dicts, lists, tensors) with every tensor copied to the host."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(item) for item in value)
    return value


def _report(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)

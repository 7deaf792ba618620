"""What the engines of several processes share: each collective tells the stall watchdog what it
waits in (and a stall report names it), and a sharded optimizer's gradients, and gradients with bf16
on the wire or PowerSGD, go through the same `synchronize` as averaged ones."""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from pathlib import Path
from typing import Any, Iterator

import torch

from hvdtrain.engine.base import Engine, GradientSync, extra_state, set_extra_state
from hvdtrain.engine.bf16_average import Bf16Average
from hvdtrain.engine.powersgd import PowerSGD
from hvdtrain.engine.segments import SegmentCollectives
from hvdtrain.engine.sharded import ShardedGradients
from hvdtrain.engine.activity import Activity
from hvdtrain.engine.watchdog import Board, StallWatchdog
from hvdtrain.engine.whereabouts import Whereabouts
from hvdtrain.errors import note_where_the_job_stood


class WatchedEngine(Engine):
    """An engine of several processes whose every collective records in `activity` what it waits in,
    so that the stall watchdog can name the ranks missing from it. Subclasses implement the
    collectives as the `_`-prefixed methods; each is wrapped here, once for every engine."""

    activity: Activity
    _watchdog: StallWatchdog | None = None
    _exchange: Bf16Average | PowerSGD | None = None
    """Gradients averaged by hvdtrain itself (bf16 on the wire, PowerSGD), not by the engine's optimizer."""
    whereabouts: Whereabouts | None = None

    def watch(self, stall_timeout: int, elastic: bool) -> None:
        """dist: every rank, once started: the report channel to rank 0 (not in elastic training, whose
        ranks change) and the stall watchdog (stall_timeout 0: none)."""
        if stall_timeout > 0:  # first: the channel's own start-up collectives are watched too
            self._watchdog = StallWatchdog(self.activity, self._board(), stall_timeout, rank=lambda: self.rank,
                                           size=lambda: self.size).start()
        if not elastic:
            self.whereabouts = Whereabouts.open(self)
            if self._watchdog is not None:
                self._watchdog.whereabouts = self.whereabouts

    def _board(self) -> Board | None:
        """Where ranks publish their Activity for a stall report without the report channel."""
        return None

    def at(self, where: str) -> None:
        self.activity.at(where)

    def doing(self, phase: str) -> str:
        return self.activity.enter(phase)

    def phase_seconds(self) -> tuple[float, float, float, float]:
        return self.activity.clock()

    def report_into(self, run_dir: Path) -> None:
        if self.whereabouts is not None:
            self.whereabouts.report_into(run_dir)

    @contextlib.contextmanager
    def _collective(self, name: str) -> Iterator[None]:
        """Waits in collective `name`; where it broke off (another rank failed or left) goes with its error."""
        with self.activity.waiting(name):
            try:
                yield
            except Exception as err:
                if self.is_engine_signal(err):
                    note_where_the_job_stood(err, self.activity.where, first=True)
                raise

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                       sync: GradientSync) -> torch.optim.Optimizer:
        if not sync.shard and (sync.compression not in ("bf16", "powersgd") or self.size == 1):
            return self._wrap_optimizer(optimizer, model, sync)  # one process: nothing sent, nothing compressed
        # In the model's order (backward's, reversed), not the optimizer's (AdamW's groups list the matrices,
        # then the biases): buckets then fill as backward goes and start early; plan deals out the same.
        order = {param: index for index, param in enumerate(model.parameters())}
        params = sorted((p for group in optimizer.param_groups for p in group["params"] if p.requires_grad),
                        key=lambda p: order.get(p, len(order)))
        if sync.compression == "powersgd":
            self.powersgd = PowerSGD(params, self._segment_collectives(), sync.powersgd_rank, sync.seed,
                                     sync.loss_scale)
            self._exchange = self.powersgd
        elif not sync.shard:
            self._exchange = Bf16Average(params, self._segment_collectives(), sync.accumulate)
        if self._exchange is not None:
            self._exchange_name = f"the gradient exchange ({sync.compression})"
            return optimizer  # `step` is the optimizer's own: the gradients are averaged before it
        self.gradient_shards = ShardedGradients(params, self._segment_collectives(), sync.accumulate,
                                                sync.compression, watch=self._collective)
        # dist: after each step (only when taken: the gradient scaler and a non-finite skip decide alike
        # on every rank) every rank gets the others' updated parameters.
        optimizer.register_step_post_hook(lambda *_: self.gradient_shards.gather_parameters())
        return optimizer  # `step` is the optimizer's own, on this rank's share of the gradients

    def synchronize(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.gradient_shards is not None:
            with self._collective("the gradient reduce-scatter"):
                self.gradient_shards.wait()
            return True
        if self._exchange is not None:
            with self._collective(self._exchange_name):
                self._exchange.wait()
            return True
        if self._updates_in_step():
            return False
        with self._collective("the gradient allreduce"):
            self._synchronize(optimizer)
        return True

    def skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        if self.gradient_shards is not None or self._exchange is not None:
            return contextlib.nullcontext()  # `step` never exchanges anything here
        return self._skip_synchronize(optimizer)

    def _updates_in_step(self) -> bool:
        """Whether the optimizer combines parameter updates inside `step` (Adasum): no gradient allreduce."""
        return False

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        with self._collective("broadcast of the parameters"):
            self._broadcast_parameters(model)  # its tensors
            extra = extra_state(model)  # the same keys on every rank (alike.check_same_model)
            if extra:  # dist: rank 0's, set by each module's set_extra_state
                set_extra_state(model, self._broadcast_object(extra, "extra_state"))

    def broadcast_object(self, obj: Any, name: str) -> Any:
        with self._collective(f"broadcast '{name}'"):
            return self._broadcast_object(obj, name)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        with self._collective(f"allgather '{name}'"):
            return self._allgather_object(obj, name)

    def gather_object(self, obj: Any, name: str) -> list[Any] | None:
        with self._collective(f"gather '{name}'"):
            return self._gather_object(obj, name)

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        with self._collective(f"allreduce '{name}'"):
            return self._allreduce_sum(tensor, name)

    def send_to_root(self, obj: Any, sender: int, name: str) -> Any:
        with self._collective(f"rank {sender} sending '{name}' to rank 0"):
            return self._send_to_root(obj, sender, name)

    def barrier(self) -> None:
        with self._collective("barrier"):
            self._barrier()

    def shutdown(self, finished: bool = False) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()  # and joined: its thread must not be inside the engine's calls at exit
        if self.whereabouts is not None:
            self.whereabouts.close()
        self._shutdown(finished)

    @abstractmethod
    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                        sync: GradientSync) -> torch.optim.Optimizer: ...

    @abstractmethod
    def _segment_collectives(self) -> SegmentCollectives: ...

    @abstractmethod
    def _synchronize(self, optimizer: torch.optim.Optimizer) -> None: ...

    @abstractmethod
    def _skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager: ...

    @abstractmethod
    def _broadcast_parameters(self, model: torch.nn.Module) -> None: ...

    @abstractmethod
    def _broadcast_object(self, obj: Any, name: str) -> Any: ...

    @abstractmethod
    def _allgather_object(self, obj: Any, name: str) -> list[Any]: ...

    @abstractmethod
    def _gather_object(self, obj: Any, name: str) -> list[Any] | None: ...

    @abstractmethod
    def _allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor: ...

    @abstractmethod
    def _send_to_root(self, obj: Any, sender: int, name: str) -> Any: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _shutdown(self, finished: bool) -> None: ...

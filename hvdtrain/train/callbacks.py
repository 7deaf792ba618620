"""Callbacks: the user's code at fixed points of `fit`, on every rank, and a stop that every rank
takes together.

    horovodrun -np 2 hvdtrain fit --callback mymodule:MyCallback --early-stopping-patience 3
    hvdtrain.fit(..., callbacks=[MyCallback()], early_stopping_patience=3)

A callback is any object with some of these methods, each given a read-only `FitState`:

    on_fit_start(state)             the ranks have set up and hold rank 0's weights
    on_step_end(state)              after each optimizer step; state.metrics: this rank's train_loss
    on_epoch_end(state)             after validation; state.metrics: the epoch's record (reduced)
    on_checkpoint(state, path)      after a checkpoint is written (path: on rank 0's file system)
    on_fit_end(state, summary)      the summary, as returned by fit

`state.stop(reason)` on any one rank stops every rank at the same optimizer step (at the next stop
check, or at the epoch's end when asked from on_epoch_end), with a checkpoint there; the summary
says why (`stopped`), and `--resume` can continue the run later.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from torch import nn

from hvdtrain.errors import SHOWS_THE_TRACEBACK, FailedAt, UserError, message_lines, note_where_the_job_stood, where
from hvdtrain.factory import resolve_factory

# Each hook with the arguments it is given: a method that cannot take them is refused at the start, not
# hours later at the first call (on_fit_end at the very end).
HOOK_ARGUMENTS = {"on_fit_start": ("state",), "on_step_end": ("state",), "on_epoch_end": ("state",),
                  "on_checkpoint": ("state", "path"), "on_fit_end": ("state", "summary")}
HOOKS = tuple(HOOK_ARGUMENTS)


class StoppedEarly(Exception):
    """Every rank stopped together because a callback (or early stopping) asked: not an error."""

    def __init__(self, reason: str, epoch: int, step: int):
        super().__init__(reason)
        self.reason, self.epoch, self.step = reason, epoch, step


@dataclass(frozen=True)
class FitState:
    """What a callback sees of the run: read-only, the same fields on every rank."""

    epoch: int
    """The epoch under way, or just ended (on_epoch_end); the last one done at on_fit_start."""
    step: int
    """Optimizer steps done, counted in steps of the current global batch."""
    metrics: Mapping[str, Any]
    """on_epoch_end and on_fit_end: the epoch's record (validation metrics reduced over ranks);
    on_step_end: this rank's train_loss of that step; otherwise empty."""
    model: nn.Module
    run_dir: Path
    rank: int
    local_rank: int
    world_size: int
    _stop: Callable[[str], None] = field(repr=False, compare=False)

    def stop(self, reason: str) -> None:
        """Asks every rank to stop together; the reason goes into the summary."""
        self._stop(reason)


class Callbacks:
    """The run's callbacks, called in the order given, and the stop one of them asked for."""

    def __init__(self, callbacks: list[Any]):
        self.callbacks = callbacks
        self.requested: str | None = None
        self.on_steps = any(hasattr(c, "on_step_end") for c in callbacks)
        self.active = bool(callbacks)
        self.engine: Any = None
        self.model: nn.Module | None = None
        self.run_dir = Path()

    def __bool__(self) -> bool:
        """Whether any rank has callbacks (after `settle`): the ranks' stop checks depend on it alike."""
        return self.active

    def settle(self, engine: Any) -> None:
        """dist: every rank, once: whether any rank has callbacks, and any on_step_end. A script may give
        rank 0 alone a logger; the collectives that look for a stop must still be the same everywhere."""
        found = engine.allreduce_sum(torch.tensor([float(bool(self.callbacks)), float(self.on_steps)]),
                                     "callbacks").tolist()
        self.active, self.on_steps = found[0] > 0, found[1] > 0

    def bind(self, engine: Any, model: nn.Module, run_dir: Path) -> "Callbacks":
        """The run's engine, model and directory, once every rank has set up."""
        self.engine, self.model, self.run_dir = engine, model, run_dir
        return self

    def call(self, hook: str, epoch: int, step: int, metrics: Mapping[str, Any] | None = None, *args: Any) -> None:
        engine = self.engine
        state = FitState(epoch, step, MappingProxyType(dict(metrics or {})), self.model, self.run_dir, engine.rank,
                         engine.local_rank, engine.size, self._request)
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            left = engine.doing(f"callback {_name(callback)}.{hook}")
            try:
                method(state, *args)
                engine.doing(left)
            except Exception as err:  # dist: only this rank knows: it says so itself, every rank stops
                failed = FailedAt(f"rank {engine.rank} failed at epoch {epoch}, step {step}: callback "
                                  f"{_name(callback)}.{hook} raised {type(err).__name__}: {message_lines(err)}"
                                  f"{where(err)}; every rank stops ({SHOWS_THE_TRACEBACK})")
                note_where_the_job_stood(failed, f"epoch {epoch}, step {step}")
                raise failed from err

    def agree(self) -> str | None:
        """dist: whether any rank's callback asked to stop, and why; every rank gets the same answer."""
        asked = self.engine.allreduce_sum(torch.tensor([float(self.requested is not None)]), "callback_stop")
        return self.reason() if float(asked[0]) > 0 else None

    def reason(self) -> str:
        """dist: once the ranks agreed to stop: the first asking rank's reason, on every rank."""
        reasons = self.engine.allgather_object(self.requested, "callback_stop_reason")
        if all(reason == reasons[0] for reason in reasons):  # every rank alike (early stopping): no rank to name
            return reasons[0]
        return next(f"{reason} (rank {rank})" for rank, reason in enumerate(reasons) if reason is not None)

    def hooks_never_called(self) -> list[str]:
        """Each callback's methods named like a hook that none of HOOKS is (Keras' or Lightning's names,
        a typo): hvdtrain never calls them."""
        return [f"{_name(callback)}.{name}" for callback in self.callbacks for name in _unknown_hooks(callback)]

    def resume_early_stopping(self, best: dict[str, Any] | None) -> None:
        for callback in self.callbacks:
            if isinstance(callback, EarlyStopping):
                callback.resume(best)

    def _request(self, reason: str) -> None:
        if self.requested is None:
            self.requested = str(reason)


class EarlyStopping:
    """Stops when the best metric has not improved for `patience` epochs in a row (by more than
    `min_delta`). Validation metrics are reduced over ranks, so every rank decides alike."""

    def __init__(self, key: str, higher: bool, patience: int, min_delta: float = 0.0):
        self.key, self.higher, self.patience, self.min_delta = key, higher, patience, min_delta
        self.best: float | None = None
        self.best_epoch = 0

    def resume(self, best: dict[str, Any] | None) -> None:
        """A resumed run's best epoch so far (from metrics.jsonl, the same on every rank)."""
        if best and best.get(self.key) is not None:
            self.best, self.best_epoch = float(best[self.key]), int(best["epoch"])

    def on_epoch_end(self, state: FitState) -> None:
        value = state.metrics.get(self.key)
        if value is None or not math.isfinite(value):
            return
        better = self.best is None or (value > self.best + self.min_delta if self.higher
                                       else value < self.best - self.min_delta)
        if better:
            self.best, self.best_epoch = value, state.epoch
        elif state.epoch - self.best_epoch >= self.patience:
            state.stop(f"early stopping: {self.key} has not improved for {self.patience} epochs "
                       f"(best {self.best:.4f} at epoch {self.best_epoch})")


def build_callbacks(names: str, best: tuple[str, bool], patience: int | None, min_delta: float) -> Callbacks:
    """The callbacks named (`package.module:Class`, or an object there; comma-separated), then early stopping."""
    made = [_made(name.strip()) for name in names.split(",") if name.strip()]
    if patience is not None:
        made.append(EarlyStopping(best[0], best[1], patience, min_delta))
    return Callbacks(made)


def _made(path: str) -> Any:
    found = resolve_factory(path, "callback", require_callable=False)
    if inspect.isclass(found) or (inspect.isfunction(found) and not _has_hook(found)):
        try:
            found = found()
        except Exception as err:
            raise UserError(f"callback '{path}': making it raised {type(err).__name__}: {err} (it is called with no "
                            "arguments)") from err
    if not _has_hook(found):
        unknown = "".join(f"; {name} is none of them" for name in _unknown_hooks(found))
        raise UserError(f"callback '{path}' has none of the methods {', '.join(HOOKS)}{unknown}: define at least "
                        "one (each takes the state; see README, Callbacks)")
    for hook, arguments in HOOK_ARGUMENTS.items():
        _check_takes(found, path, hook, arguments)
    return found


def _check_takes(callback: Any, path: str, hook: str, arguments: tuple[str, ...]) -> None:
    method = getattr(callback, hook, None)
    if not callable(method):
        return
    try:
        signature = inspect.signature(method, follow_wrapped=False)  # a decorator's wrapper is what is called
    except (TypeError, ValueError):  # a builtin or an extension's method: taken on trust
        return
    try:
        signature.bind(*arguments)
    except TypeError:
        raise UserError(f"callback '{path}': {_name(callback)}.{hook}{signature} cannot be called as "
                        f"{hook}({', '.join(arguments)}), as hvdtrain calls it: give it those parameters "
                        "(see README, Callbacks)") from None


def _unknown_hooks(callback: Any) -> list[str]:
    return [name for name in dir(callback) if name.startswith("on_") and name not in HOOK_ARGUMENTS
            and callable(getattr(callback, name, None))]


def _has_hook(thing: Any) -> bool:
    return any(callable(getattr(thing, hook, None)) for hook in HOOKS)


def _name(callback: Any) -> str:
    return type(callback).__name__

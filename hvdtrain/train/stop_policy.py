"""Stopping inside an epoch: signals (SIGTERM from Slurm, Kubernetes or a launcher, SIGUSR1 from
Slurm's --signal), checkpoints every N steps or M minutes, and a callback's stop: the `StopPolicy`
that `Trainer` asks after each optimizer step and at each epoch's end.

A signal may reach one rank, some or all of them. Each rank only notes it; about every half second,
at an optimizer step they all agree on, the ranks add up what they noted in one tiny allreduce, so
all of them see the same answer at the same step, write the checkpoint there together and stop.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from typing import Any, Callable

import torch

from hvdtrain.config import RunConfig
from hvdtrain.config.schema import signal_numbers
from hvdtrain.engine import Engine
from hvdtrain.engine.parent_death import agent_gone
from hvdtrain.errors import StoppedBySignal
from hvdtrain.io import run_lock
from hvdtrain.train import early_signals
from hvdtrain.train.callbacks import Callbacks, StoppedEarly

# What a stop raises, made only at the raise (`raise stop()`): an exception held in a local of a frame
# in its own traceback would keep that frame, and the data-loader workers it iterates, alive past exit.
Stop = Callable[[], Exception]


class StopSignals:
    """Notes the configured signals instead of dying on them; a second one ends the process as the
    signal's default would (so a scheduler's or user's insistence still works). Once training has
    ended well, SIGUSR1 (the scheduler's warning) is ignored instead (`early_signals`).

    In a process that goes on after fit (the Python API: a notebook, a script) insisting goes to the
    handler the process had before fit (Ctrl-C twice: KeyboardInterrupt, not the kernel killed), and
    after a stop the handlers go back at the first signal past the late-copy window."""

    # A repeat within this many seconds is the same delivery reaching this process twice (Slurm
    # signals every process of a step, and a launcher passes the signal on as well).
    SAME_DELIVERY_SECONDS = early_signals.SAME_DELIVERY_SECONDS

    def __init__(self, names: str):
        self.numbers = signal_numbers(names)
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}
        self._stopped_at: float | None = None  # fit stopped on a signal in a process that goes on

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python takes signals there only
            for number in self.numbers:
                if number == signal.SIGHUP and signal.getsignal(number) == signal.SIG_IGN:
                    continue  # nohup's: the job outlives the terminal, as it was started to
                self._previous[number] = _before_stop_signals(signal.signal(number, self._note), number)
            # Then the one that came while fit was starting: no moment without a handler in between.
            early, originals = early_signals.take_over(set(self.numbers))
            self._previous.update({n: _before_stop_signals(h, n) for n, h in originals.items() if n in self._previous})
            if early is not None and self.received is None:
                self.received, self._received_at = early, time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        if kind is not None and issubclass(kind, StoppedBySignal):
            # Stopping, maybe on another rank's signal: this rank's own copy may come now (torchrun's
            # agent passes it to one worker after another) and must not kill it as the default would.
            # The command's process ends soon; one that goes on gets its handlers back in `_note`.
            if not early_signals.in_the_command():
                self._stopped_at = time.monotonic()
            return
        if kind is None:  # trained to the end: a scheduler's warning from here on has nothing to stop
            early_signals.ignore_after_training(self._previous)
        elif self.received is not None:  # a failure came before the stop: the report acts on the signal
            early_signals.note_unserved(self.received)
        self._give_back()

    def _give_back(self) -> None:
        for number, handler in self._previous.items():
            if signal.getsignal(number) == self._note:
                signal.signal(number, handler)

    def _note(self, number: int, frame: Any) -> None:
        now = time.monotonic()
        if self._stopped_at is not None:  # fit has returned, and the process went on
            late = now - max(self._stopped_at, self._received_at) < self.SAME_DELIVERY_SECONDS
            if late:
                return  # a late copy of the stop (another rank's, or another signal of the same stop)
            self._give_back()
            signal.raise_signal(number)  # to the process's own handler, as if fit had never been
            return
        if self.received is not None:
            # Within the window, any stop signal is the same stop reaching this process again: a launcher's
            # copy, or a logout's SIGTERM with the terminal's SIGHUP.
            if now - self._received_at < self.SAME_DELIVERY_SECONDS:
                return
            if number == signal.SIGTERM and agent_gone():  # torchrun's agent died: its word, not a user's
                return
            # Insisting: die as this signal would; in a process that goes on, its own handler takes it.
            if early_signals.in_the_command():
                run_lock.note_ending({"ended": f"ended by a second {signal.Signals(number).name}"})
            signal.signal(number, signal.SIG_DFL if early_signals.in_the_command() else
                          self._previous.get(number, signal.SIG_DFL))
            signal.raise_signal(number)
            return
        self.received, self._received_at = number, now


def _before_stop_signals(handler: Any, number: int) -> Any:
    """The handler to give back: an earlier fit's, which stopped in this process and kept its own until
    the next signal, stands for what there was before that fit."""
    earlier = getattr(handler, "__self__", None)
    if isinstance(earlier, StopSignals) and getattr(handler, "__func__", None) is StopSignals._note \
            and earlier._stopped_at is not None:
        return earlier._previous.get(number, signal.SIG_DFL)
    return handler


class StopPolicy:
    """After each optimizer step: whether to write a checkpoint here, and whether to stop after it;
    at an epoch's end, whether to stop there.

    Every-N-steps checkpoints need no agreement (the step count is the same everywhere); a signal
    and rank 0's clock do, so they travel in one small allreduce. Not after every step: about every
    run.stop_check_seconds, in steps that rank 0 measures and sends along in the same allreduce, so every
    rank checks at the same steps and the check costs well under 1% even when steps are short.
    """

    MAX_INTERVAL = 1000

    def __init__(self, cfg: RunConfig, engine: Engine, signals: StopSignals | None, callbacks: Callbacks | None = None):
        self.every_steps = cfg.checkpoint_every_steps
        self.every_seconds = cfg.checkpoint_every_minutes * 60 if cfg.checkpoint_every_minutes else None
        self.check_seconds = cfg.stop_check_seconds
        self.engine, self.signals, self.callbacks = engine, signals, callbacks
        self.last_checkpoint = time.monotonic()
        self.agree = (bool(signals and signals.numbers) or self.every_seconds is not None
                      or bool(callbacks and callbacks.on_steps))
        self.callback_stop = False
        """Set at a check where a callback on some rank asked to stop: every rank stops at that step."""
        self.signal_at_epoch_end: str | None = None
        """The signal every rank stops for at the end of this epoch (`at_epoch_end`), if any."""
        self.next_check, self.interval = 0, 1
        self.last_check: tuple[int, float] | None = None  # (step, time) of the previous check

    def after_step(self, step: int, last_of_epoch: bool) -> tuple[bool, str | None]:
        """(checkpoint now, the signal to stop for or None) at global step `step`."""
        stop = None
        due = self.every_steps is not None and step % self.every_steps == 0 and not last_of_epoch
        if self.agree and step >= self.next_check:
            numbers = self.signals.numbers if self.signals else []
            noted = [float(self.signals is not None and self.signals.received == n) for n in numbers]
            noted.append(float(self.callbacks is not None and self.callbacks.requested is not None))
            now = time.monotonic()
            timed = (self.every_seconds is not None and self.engine.is_root
                     and now - self.last_checkpoint >= self.every_seconds and not last_of_epoch)
            proposed = self._interval(step, now) if self.engine.is_root else 0
            flags = self.engine.allreduce_sum(torch.tensor([*noted, float(timed), float(proposed)],
                                                           dtype=torch.float64),
                                              "stop_check").tolist()  # dist: what any rank noted, all learn
            stop = next((signal.Signals(n).name for n, count in zip(numbers, flags) if count > 0), None)
            self.callback_stop = stop is None and flags[len(numbers)] > 0
            due = due or flags[-2] > 0 or self.callback_stop
            self.interval = int(flags[-1])  # dist: rank 0's, the same on every rank
            self.next_check = step + self.interval
        if due or stop:
            self.last_checkpoint = time.monotonic()
        return due or stop is not None, stop

    def saved(self) -> None:
        """A checkpoint was written at an epoch's end."""
        self.last_checkpoint = time.monotonic()

    def stop_at_step(self, stop: str | None, epoch: int, step: int) -> Stop | None:
        """What stops every rank after `after_step` said (`stop`: its signal), at `step` of `epoch`;
        None to go on."""
        if stop is not None:
            return functools.partial(StoppedBySignal, f"stopped by {stop} at epoch {epoch}, step {step:,}: "
                                     "checkpoint written; continue with --resume")
        if self.callback_stop:  # dist: every rank learnt it in the same check, at this step
            return functools.partial(StoppedEarly, self.callbacks.reason(), epoch, step)  # type: ignore[union-attr]
        return None

    def at_epoch_end(self, epoch: int, step: int) -> Stop | None:
        """What stops every rank at the end of `epoch` (not the last): a signal agreed there (one arriving
        during evaluation or the epoch's checkpoint), else a callback's stop; None to go on."""
        # dist: a signal during evaluation or the checkpoint write stops every rank here, not a step later.
        stop = self.signal_at_epoch_end = self._signal_at_epoch_end()
        if stop is not None:
            return functools.partial(StoppedBySignal, f"stopped by {stop} at the end of epoch {epoch}, step "
                                     f"{step:,}: checkpoint written; continue with --resume")
        reason = self.callbacks.agree() if self.callbacks else None  # dist: one answer for every rank
        return functools.partial(StoppedEarly, reason, epoch, step) if reason is not None else None

    def _signal_at_epoch_end(self) -> str | None:
        numbers = self.signals.numbers if self.signals else []
        if not numbers:
            return None
        noted = [float(self.signals.received == n) for n in numbers]  # type: ignore[union-attr]
        flags = self.engine.allreduce_sum(torch.tensor(noted, dtype=torch.float64), "stop_check_epoch_end").tolist()
        return next((signal.Signals(n).name for n, count in zip(numbers, flags) if count > 0), None)

    def _interval(self, step: int, now: float) -> int:
        """Steps until the next check: about stop_check_seconds of the steps just measured."""
        previous, self.last_check = self.last_check, (step, now)
        if previous is None or step <= previous[0] or self.check_seconds == 0:
            return 1  # the first check (after a resume too) only starts the measurement
        last_step, last_time = previous
        per_step = (now - last_time) / (step - last_step)
        return max(1, min(self.MAX_INTERVAL, int(self.check_seconds / max(per_step, 1e-6))))


class NeverStop(StopPolicy):
    """Elastic training's policy: no signals, no checkpoints inside an epoch, no callbacks (its commits
    are its checkpoints; Horovod's driver replaces a worker that dies)."""

    def __init__(self) -> None:
        self.callback_stop, self.signal_at_epoch_end = False, None

    def after_step(self, step: int, last_of_epoch: bool) -> tuple[bool, str | None]:
        return False, None

    def saved(self) -> None:
        pass

    def at_epoch_end(self, epoch: int, step: int) -> Stop | None:
        return None

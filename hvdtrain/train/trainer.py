"""The fit object: `Trainer` owns the run, its config and engine, and the components around the loop:
the checkpointer, the loggers and the stop policy (and the user's callbacks). Plain and elastic `fit`
drive it alike: `prepare`, then `begin` for the processes there are, then `run_epochs`, then `finish`;
elastic training adds its commits as `Hooks`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from hvdtrain.alike import check_same_settings, settings
from hvdtrain.config import Config
from hvdtrain.data.augment import on_device
from hvdtrain.engine import Engine
from hvdtrain.errors import StoppedBySignal, UserError, where_the_job_stood
from hvdtrain.io.checkpoint import Start
from hvdtrain.io.progress import say
from hvdtrain.io import run_lock
from hvdtrain.io.run_dir import after_a_restart, check_run_dir, prepare_run_dir
from hvdtrain.model_layout import check_same_model
from hvdtrain.models import unwrapped
from hvdtrain.train.callbacks import Callbacks, StoppedEarly
from hvdtrain.train.checkpointer import Checkpointer, restore
from hvdtrain.train.failures import located
from hvdtrain.train.loggers import Loggers
from hvdtrain.train.loop import EpochResult, EpochSums, EvalResult, Training, evaluate, train_epoch
from hvdtrain.train.random_state import seed_epoch, set_rng_state
from hvdtrain.train.running_stats import share_running_stats
from hvdtrain.train.schedule import learning_rate
from hvdtrain.train.setup import (MadeData, Run, Shard, build, check_same_data, check_task, holdings_line,
                                  keep_learning_rate, shard)
from hvdtrain.train.stop_policy import NeverStop, StopPolicy
from hvdtrain.train.stragglers import RankTimes, gather_times, stragglers
from hvdtrain.train.summary import Totals, say_how_it_ended, summarize


class Hooks:
    """Points of the epochs where a kind of fit adds its own work (elastic training: its commits)."""

    def after_step(self, step: int, done: int, position: int) -> None:
        """After optimizer step `step`, `done` steps into this epoch's training, at global `position` of its order."""

    def after_epoch(self, epoch: int, step: int) -> None:
        """After `epoch` is recorded and checkpointed; `step`: the steps done."""


@dataclass
class _Epoch:
    """The epoch under way."""

    number: int
    first_step: int
    start: int
    """The global position of its order that training starts from."""
    steps: int
    """Optimizer steps it trains (from `start`)."""
    sums: EpochSums
    where: str
    """Where a failure of the user's code is reported."""
    times: RankTimes | None = None
    """Each rank's training time, split (at the epoch's end)."""


class Trainer:
    """One `fit`. Nothing distributed happens in the constructor; every method that is a collective
    says so, and every rank calls it at the same point."""

    def __init__(self, config: Config, engine: Engine, started: float):
        self.config, self.engine = config, engine
        # As this rank was started: a resume sets optim.lr_batch later, an elastic worker's before one that joins
        self.started_with = settings(config)
        self.totals = Totals(started, 0)
        self.callbacks = Callbacks([])
        self.stops: StopPolicy = NeverStop()
        self.hooks = Hooks()
        self.run_dir: Path | None = None  # rank 0's, until `begin`
        self.claimed: Path | None = None  # rank 0's claim on its run directory (run_lock), let go at the end
        self.resumed_optimizer: dict[str, Any] | None = None
        """Rank 0, resuming with a sharded optimizer: the whole optimizer state, for the others' shares."""
        self.resumed_powersgd: dict[str, Any] | None = None
        """Rank 0, resuming with PowerSGD: every rank's errors and the factors."""
        self.loggers: Loggers | None = None
        self.trains = False  # rank 0: its run directory is this fit's (a resume refused before: not)

    # --- set-up, the same for plain and elastic fit

    def prepare(self, made: MadeData | None = None) -> None:
        """Data (or what `make_data` `made` of it before), model and optimizer, this rank's shard, and the task
        checked on one batch (no collectives)."""
        self.run: Run = build(self.config, self.engine, made)
        if self.engine.gradient_shards is not None:  # every rank's own line, beside its start line
            sys.stderr.write(f"hvdtrain: {holdings_line(self.run, self.config, self.engine)}\n")
        self.shard: Shard = shard(self.run, self.config, self.engine)
        self.first, self.best = check_task(self.run, self.config, self.engine)

    def check_settings_alike(self) -> None:
        """Every rank's settings the same as rank 0's (collectives)."""
        check_same_settings(self.started_with, self.engine)  # dist

    def check_built_alike(self) -> None:
        """Every rank's data set and model the same as rank 0's (collectives)."""
        check_same_data(self.run, self.engine)  # dist
        check_same_model(unwrapped(self.run.model), self.engine)  # dist

    def check_run_dir(self) -> None:
        """Rank 0: the run directory's refusals (--resume, --overwrite, another job there), nothing made yet."""
        check_run_dir(after_a_restart(self.config.run, lambda line: None), claimed=not self.config.train.elastic)

    def start_on_root(self) -> Start:
        """On rank 0, after every check passed: the run directory, and the checkpoint when resuming.
        Returns where training begins; the beginning elsewhere."""
        if not self.engine.is_root:  # dist: rank 0 alone owns the run directory
            return Start()
        # Not under --elastic: a process that joins as rank 0 while the first rank 0 lives claims again.
        run = after_a_restart(self.config.run, say)
        self.run_dir, resuming = prepare_run_dir(run, claimed=not self.config.train.elastic)
        self.claimed = run_lock.key(self.run_dir)
        start = Start()
        if resuming:
            start, self.resumed_optimizer, self.resumed_powersgd = restore(self.run, self.config, self.run_dir,
                                                                           self.engine)
        self.trains = True
        return start

    def reshard(self) -> None:
        """This rank's batches for the processes there are now."""
        self.end_data_workers(at_once=True)  # the last attempt's: a lost process's exception may keep them alive
        self.shard = shard(self.run, self.config, self.engine)

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """The fit inside, then what it holds let go, on every way out: the data loaders' worker processes
        (a failure's frames keep the loaders alive, and their workers would keep the process, a user's
        script too, from exiting; after a failure or a stop they are killed, not waited for), then rank
        0's claim on the run directory."""
        ended = None
        try:
            yield
        except BaseException as err:
            ended = self._how_it_ended(err) if self.trains else run_lock.KEEP_THE_NOTE
            self.end_data_workers(at_once=True)
            raise
        else:
            self.end_data_workers()
        finally:
            run_lock.release(self.claimed, ended)

    def _how_it_ended(self, err: BaseException) -> dict[str, str]:
        """For the run directory's lock note (`hvdtrain runs`): a stop on a signal, an interrupt or a failure,
        and where the failure's own line put it (`at`: "epoch 1, step 15"), where it said."""
        if isinstance(err, StoppedBySignal):  # "stopped by SIGTERM at epoch 3, step 1,234: checkpoint written..."
            return {"ended": str(err).partition(":")[0]}
        if isinstance(err, KeyboardInterrupt):
            return {"ended": "interrupted"}
        position = (where_the_job_stood(err) or ("",))[0]
        # A step of training, as the failure's line put it; not the engine's own words ("set-up", a wait).
        at = {"at": position} if re.fullmatch(r"epoch [1-9]\d*, step [\d,]+", position) else {}
        if self.engine.is_engine_signal(err):
            return {"ended": "failed", "error": "another rank failed or left", **at}
        return {"ended": "failed", "error": (str(err).strip().splitlines() or [type(err).__name__])[0][:300], **at}

    def end_data_workers(self, at_once: bool = False) -> None:
        current = getattr(self, "shard", None)
        if current is not None:
            current.end_workers(at_once)

    def begin(self, run_dir: Path, start: Start, totals: Totals) -> int:
        """The components for the processes there are now, from `start`: the learning rate (the run's own
        reference batch, on resume), the loggers (rank 0's run files) and the checkpointer. Returns the
        step number there."""
        config, engine, steps = self.config, self.engine, self.shard.steps
        self.run_dir, self.totals = run_dir, totals
        keep_learning_rate(config, start.lr_batch)  # dist: rank 0's checkpoint's, on every rank
        self.learning_rate = learning_rate(config, steps)
        self.training = Training(self.run.model, self.run.optimizer, self.run.task, self.learning_rate,
                                 config.train.accumulate, config.optim.clip_grad_norm, self.run.precision,
                                 config.train.channels_last, config.train.nonfinite,
                                 on_device(self.run.split.train))
        step = steps.at(start.epoch, start.position)
        if self.loggers is not None:  # an attempt that a change of processes ended: its TensorBoard writer too
            self.loggers.close()
        self.loggers = Loggers(config, engine, run_dir)
        self.loggers.open(start.epoch, step, f"world size {engine.size}, global batch {steps.samples}, "
                          f"{len(self.shard.sampler)} batches per rank per epoch", self.shard.sampler.dropped_note())
        if engine.is_root:  # dist: the window's sum is every rank's; the others go on from zero
            self.loggers.step_log.resume(start.step_window)
        self.checkpointer = Checkpointer(self.run, config, engine, run_dir, self.best, self.loggers.step_log)
        if engine.is_root:  # stall reports and `hvdtrain where` keep every rank's stacks here
            engine.report_into(run_dir)
        return step

    # --- the epochs

    def run_epochs(self, start: Start, step: int) -> None:
        """Every epoch after `start` (going on inside the first where it stopped there)."""
        for epoch in range(start.epoch + 1, self.config.train.epochs + 1):
            resumed = start if epoch == start.epoch + 1 and start.position else None
            step = self.run_epoch(epoch, step, resumed)
            self.hooks.after_epoch(epoch, step)

    def run_epoch(self, epoch: int, step: int, resumed: Start | None = None) -> int:
        """Trains one epoch (from where `resumed` stopped inside it), evaluates, and on rank 0 records it
        and checkpoints. Returns the next step number."""
        now = self._begin_epoch(epoch, step, resumed)
        train, val, step, seconds = self._train_and_evaluate(now)
        metrics = self._record(now, train, val, step, seconds, now.times)
        self.engine.at(f"the end of epoch {epoch}")  # for a stall report: checkpoint, callbacks, the stop check
        last = epoch == self.config.train.epochs
        saved = epoch % self.config.run.checkpoint_every == 0 or last
        if saved:
            self._save_epoch(epoch, step, metrics)
        if self.callbacks:
            self.callbacks.call("on_epoch_end", epoch, step, self.totals.record)
        stop = self.stops.at_epoch_end(epoch, step) if not last else None  # dist: one answer for every rank
        if stop is not None:
            if not saved:
                self._say_stopping(self.stops.signal_at_epoch_end, f"the end of epoch {epoch}")
                self._save_epoch(epoch, step, metrics)
            raise stop()
        return step

    def _say_stopping(self, signal: str | None, where: str) -> None:
        """Rank 0, as soon as every rank agreed to stop on a signal and before the checkpoint (which may take
        minutes): the user who pressed Ctrl-C learns that it was heard, and what a second one costs."""
        if signal is not None and self.engine.is_root:
            say(f"hvdtrain: {signal}: every rank stops at {where}, writing a checkpoint first (a second signal, "
                "2 s or more later, ends the job at once without it)", err=True)

    def _begin_epoch(self, epoch: int, step: int, resumed: Start | None) -> _Epoch:
        engine = self.engine
        sums = EpochSums()
        if resumed is not None and engine.is_root:  # dist: the reduced sums once, on one rank
            sums = EpochSums(*resumed.sums)
        if resumed is not None and resumed.rng is not None and len(resumed.rng) == engine.size:
            set_rng_state(resumed.rng[engine.rank])  # dist: each rank's own, exactly where it stopped
        else:  # a new epoch, or another world size: each rank's randomness is its own anyway
            seed_epoch(self.config.train.seed, epoch, engine.rank)
        start = resumed.position if resumed is not None else 0
        sampler = self.shard.sampler
        sampler.begin_epoch(epoch, start, resumed.stream_plan if resumed is not None else None,
                            resumed.world_size if resumed is not None else engine.size)
        steps = self.shard.steps.left(sampler)
        self.loggers.begin_epoch(epoch, steps, step)  # type: ignore[union-attr]
        return _Epoch(epoch, step, start, steps, sums, f"epoch {epoch}, step {step + 1}")

    def _train_and_evaluate(self, now: _Epoch) -> tuple[EpochResult, EvalResult, int, float]:
        engine, run, epoch = self.engine, self.run, now.number
        engine.at(f"epoch {epoch}, training from step {now.first_step}")
        epoch_start, clock = time.perf_counter(), engine.phase_seconds()
        try:
            train, step = train_epoch(self.training, engine, self.shard.train_batches, first_step=now.first_step,
                                      epoch=epoch,
                                      sums=now.sums, on_step=functools.partial(self._after_step, now))
            seconds = time.perf_counter() - epoch_start
            now.times = gather_times(engine, clock)  # dist: where each rank's time went
            self.loggers.end_epoch()  # type: ignore[union-attr]
            engine.at(f"epoch {epoch}, evaluation")
            now.where = f"epoch {epoch}, evaluation"
            share_running_stats(run.model, engine, self.config.train.dist_bn)  # dist: what validation and checkpoint use
            val = evaluate(run.model, engine, run.task, self.shard.val_batches, self.first.template, run.precision,
                           self.config.train.channels_last)
        except Exception as err:
            raise located(err, engine, now.where, self.checkpointer.last)
        return train, val, step, seconds

    def _after_step(self, now: _Epoch, step: int, loss: torch.Tensor) -> None:
        """After each optimizer step, on every rank: the loggers, the hooks, the callbacks, then the stop
        policy's checkpoint and stop."""
        now.where = f"epoch {now.number}, step {step + 1}"
        self.engine.at(f"epoch {now.number}, training after step {step}")  # dist: for a stall report
        self.loggers.log_step(step, loss, self.learning_rate)  # type: ignore[union-attr]
        done = step - now.first_step
        position = self.shard.steps.position(now.start, done)
        self.hooks.after_step(step, done, position)
        if self.callbacks.on_steps:
            self.callbacks.call("on_step_end", now.number, step, {"train_loss": float(loss)})
        write, signal = self.stops.after_step(step, last_of_epoch=done == now.steps)
        if signal is not None:
            self.loggers.end_epoch()  # type: ignore[union-attr]
            self._say_stopping(signal, f"epoch {now.number}, step {step:,}")
        if write:
            self.checkpointer.save_inside(now.number, step, self.learning_rate.lr_batch, position, now.sums,
                                          self.shard.sampler)
            self.engine.at(f"epoch {now.number}, training after step {step}")  # the write is over
            if self.callbacks:
                self.callbacks.call("on_checkpoint", now.number, step, None, self.checkpointer.last)
        stop = self.stops.stop_at_step(signal, now.number, step)
        if stop is not None:
            self.loggers.end_epoch()  # type: ignore[union-attr]
            raise stop()

    def _record(self, now: _Epoch, train: EpochResult, val: EvalResult, step: int, seconds: float,
                times: RankTimes | None) -> dict[str, float]:
        """The epoch's record (each rank's times, and the slow ones named), into the loggers; returns its
        validation metrics."""
        totals = self.totals
        totals.train_seconds += seconds
        totals.train_samples += train.samples
        metrics = {f"val_{name}": val.metrics[name] for name in sorted(val.metrics, key=lambda n: n != "loss")}
        totals.record = {
            "epoch": now.number, "epochs": self.config.train.epochs, "step": step, "world_size": self.engine.size,
            "train_loss": train.loss, **metrics,
            "val_samples": val.samples, "train_samples": train.samples, "skipped_steps": train.skipped_steps,
            "train_samples_per_s": train.samples / seconds, "lr": self.learning_rate(step),
            "elapsed_s": time.perf_counter() - totals.started,
        }
        if times is not None:
            slow = stragglers(times, self.config.train.straggler_factor)
            totals.record.update(times.record(), **({"stragglers": slow} if slow else {}))
        self.loggers.log_epoch(totals.record)  # type: ignore[union-attr]
        return metrics

    def _save_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> None:
        self.checkpointer.save_epoch(epoch, step, self.learning_rate.lr_batch, metrics)  # dist: every rank
        self.engine.at(f"the end of epoch {epoch}")  # for a stall report: the write is over
        self.stops.saved()  # the minutes until a timed checkpoint count from this one
        if self.callbacks:
            self.callbacks.call("on_checkpoint", epoch, step, None, self.checkpointer.last)

    # --- the end

    def finish(self, stopped: StoppedEarly | None = None) -> dict[str, Any]:
        """The run's summary, the same on every rank (collective); rank 0 writes summary.json and says how
        it ended. `stopped`: every rank stopped before the last epoch (a callback, early stopping), with
        why and where."""
        summary = summarize(self.config, self.engine, self.run.task.name, self.best, self.totals, stopped)
        loggers = self.loggers
        with self.engine.agree("summary"):  # dist: a failed write on rank 0 ends every rank with its line
            if self.engine.is_root and loggers is not None:  # dist: rank 0 reads and writes the run's files
                key = self.best[0]
                best = loggers.best_record(*self.best) or {}  # over every epoch recorded, a resumed run's too
                summary.update(best_value=best.get(key), best_epoch=best.get("epoch"))
                try:
                    loggers.write_summary(summary)
                except OSError as err:
                    raise UserError(f"could not write {self.run_dir}/summary.json: {err.strerror or err}; the "
                                    "checkpoints are intact: free space, then run `hvdtrain evaluate` on them") from err
                loggers.close()
                say_how_it_ended(summary, self.totals.record or {}, best, stopped, self.run_dir)  # type: ignore[arg-type]
        return self.engine.broadcast_object(summary, "summary")  # dist: rank 0's, best_* included, on every rank

"""One epoch of a run and what surrounds the epochs: rank 0's run files, train then evaluate then
record and checkpoint (`run_epoch`), and the summary at the end (`finish`). Shared by plain and
elastic `fit`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hvdtrain.config import Config
from hvdtrain.data.loading import seed_generators
from hvdtrain.data.stream_sampler import StreamBatchSampler
from hvdtrain.engine import Engine
from hvdtrain.errors import StoppedBySignal, UserError, message_lines
from hvdtrain.io.checkpoint import CheckpointStore
from hvdtrain.io.event_log import EventLog
from hvdtrain.io.mlflow_log import MLflowLog
from hvdtrain.io.progress import EpochProgress, epoch_line, say
from hvdtrain.io.run_dir import RunFiles
from hvdtrain.train.callbacks import Callbacks, StoppedEarly
from hvdtrain.train.failures import located
from hvdtrain.train.loop import EpochSums, evaluate, train_epoch
from hvdtrain.train.preemption import StepCheck, rng_state, set_rng_state
from hvdtrain.train.running_stats import share_running_stats
from hvdtrain.train.setup import Run, Start, unwrapped


@dataclass
class Totals:
    """What the summary needs, gathered over the epochs."""

    started: float
    start_epoch: int
    record: dict[str, Any] | None = None
    train_seconds: float = 0.0
    train_samples: int = 0


def open_run_files(config: Config, engine: Engine, run: Run, run_dir: Path, start_epoch: int,
                   start_step: int) -> RunFiles | None:
    """Rank 0's writer of the run directory (None elsewhere); says where the run goes."""
    if not engine.is_root:  # dist: rank 0 writes shared files
        return None
    trackers: list[Any] = [EventLog(run_dir, resumed_at_step=start_step)] if config.run.tensorboard else []
    if config.run.mlflow:
        trackers.append(MLflowLog(run_dir, config.to_dict(), warn=lambda message: say(f"hvdtrain: warning: {message}")))
    files = RunFiles(run_dir, trackers)
    files.write_config(config.to_dict())
    files.truncate_metrics(after_epoch=start_epoch, warn=lambda message: say(f"hvdtrain: warning: {message}"))
    say(f"hvdtrain: run directory {run_dir}  (world size {engine.size}, "
        f"global batch {run.train_sampler.global_batch * config.train.accumulate}, "
        f"{len(run.train_sampler)} batches per rank per epoch)")
    dropped = getattr(run.train_sampler, "dropped", 0)
    if dropped:  # a stream's ranges are whole batches; a map-style set's drop is said in the README
        say(f"hvdtrain: streamed data: each rank reads its own range of each epoch's stream; the last {dropped:,} "
            f"of its {len(run.split.train):,} samples are left out (the end of the epoch's stream: others each "
            "epoch)")
    return files


def run_epoch(run: Run, config: Config, engine: Engine, epoch: int, step: int, totals: Totals,
              files: RunFiles | None, store: CheckpointStore, stream: Any, *, start: int = 0,
              after_step: Callable[[int], None] | None = None, check: StepCheck | None = None,
              resumed: Start | None = None, callbacks: Callbacks | None = None,
              stream_plan: dict[str, Any] | None = None) -> int:
    """Trains one epoch (from global position `start`), evaluates, and on rank 0 records it
    and checkpoints. Returns the next step number. `check` decides after each step whether to
    checkpoint inside the epoch and whether to stop; `resumed`: the mid-epoch checkpoint this
    epoch goes on from (its sums and random states); `callbacks`: the user's, called on every rank;
    `stream_plan`: of a stream, where the epoch stood (elastic training's last commit)."""
    sums = EpochSums()
    if resumed is not None:
        if engine.is_root:  # dist: the reduced sums once, on one rank
            sums = EpochSums(*resumed.sums)
        if resumed.rng is not None and len(resumed.rng) == engine.size:
            set_rng_state(resumed.rng[engine.rank])  # dist: each rank's own, exactly where it stopped
        else:  # another world size: each rank's randomness is its own anyway
            _seed(config.train.seed, epoch, engine.rank)
    else:
        _seed(config.train.seed, epoch, engine.rank)
    if start and isinstance(run.train_sampler, StreamBatchSampler):  # dist: the epoch under way, maybe on another size
        plan = stream_plan or (resumed.stream_plan if resumed is not None else None)
        run.train_sampler.resume_plan(epoch, plan or {"world_size": resumed.world_size if resumed else engine.size,
                                                      "base": 0, "runs": None, "start": start})
    run.train_sampler.set_epoch(epoch, start)  # dist: a new shuffle, the same on every rank
    epochs = config.train.epochs
    steps = len(run.train_sampler) // config.train.accumulate
    per_step = run.train_sampler.global_batch * config.train.accumulate  # dist: samples of all ranks per step
    progress = EpochProgress(stream, epoch, epochs, steps, step)
    first_step = step

    position = [f"epoch {epoch}, step {step + 1}"]  # where a failure of the user's code is reported

    def on_step(done: int, loss: torch.Tensor) -> None:
        position[0] = f"epoch {epoch}, step {done + 1}"
        engine.at(f"epoch {epoch}, training after step {done}")  # dist: for a stall report
        progress.step(done, loss)
        logged = run.step_log.step(done, loss, run.learning_rate)
        if logged is not None and files is not None:
            files.log_steps(done, logged)
        if after_step is not None:
            after_step(done)
        if callbacks is not None and callbacks.on_steps:
            callbacks.call("on_step_end", epoch, done, {"train_loss": float(loss)})
        if check is not None:
            write, stop = check(done, last_of_epoch=done - first_step == steps)
            if write:
                at = start + (done - first_step) * per_step
                _mid_epoch_checkpoint(run, config, engine, store, epoch, done, at, sums)
                if callbacks:
                    callbacks.call("on_checkpoint", epoch, done, None, store.dir / "last.pt")
            if stop is not None:
                progress.close()
                raise StoppedBySignal(f"stopped by {stop} at epoch {epoch}, step {done:,}: checkpoint written; "
                                      "continue with --resume")
            if check.callback_stop:  # dist: every rank learnt it in the same check, at this step
                progress.close()
                raise StoppedEarly(callbacks.reason(), epoch, done)

    engine.at(f"epoch {epoch}, training from step {step}")
    epoch_start = time.perf_counter()
    try:
        train, step = train_epoch(
            run.model, run.optimizer, engine, run.task, run.train_batches,
            first_step=step, learning_rate=run.learning_rate, accumulate=config.train.accumulate,
            clip_grad_norm=config.optim.clip_grad_norm, precision=run.precision,
            channels_last=config.train.channels_last, nonfinite=config.train.nonfinite, sums=sums,
            on_step=on_step,
        )
        seconds = time.perf_counter() - epoch_start
        progress.close()
        engine.at(f"epoch {epoch}, evaluation")
        position[0] = f"epoch {epoch}, evaluation"
        share_running_stats(run.model, engine, config.train.dist_bn)  # dist: what validation and checkpoint use
        val = evaluate(run.model, engine, run.task, run.val_batches, run.first.template, run.precision,
                       config.train.channels_last)
    except Exception as err:
        raise located(err, engine, position[0])
    totals.train_seconds += seconds
    totals.train_samples += train.samples
    metrics = {f"val_{name}": val.metrics[name] for name in sorted(val.metrics, key=lambda n: n != "loss")}
    totals.record = {
        "epoch": epoch, "epochs": epochs, "step": step, "world_size": engine.size,
        "train_loss": train.loss, **metrics,
        "val_samples": val.samples, "train_samples": train.samples, "skipped_steps": train.skipped_steps,
        "train_samples_per_s": train.samples / seconds, "lr": run.learning_rate(step),
        "elapsed_s": time.perf_counter() - totals.started,
    }
    if files is not None:
        files.append_metrics(totals.record)
        say(epoch_line(totals.record))
    saved = epoch % config.run.checkpoint_every == 0 or epoch == epochs

    def save() -> None:
        _save_together(engine, store, lambda: (_checkpoint_state(run, config, engine, epoch, step), epoch, metrics),
                       config.run.checkpoint_timeout)
        if check is not None:
            check.saved()  # the minutes until a timed checkpoint count from this one
        if callbacks:
            callbacks.call("on_checkpoint", epoch, step, None, store.dir / "last.pt")

    if saved:
        save()
    if callbacks:
        callbacks.call("on_epoch_end", epoch, step, totals.record)
    # dist: a signal during evaluation or the checkpoint write stops every rank here, not a step later.
    stop = check.at_epoch_end() if check is not None and epoch < epochs else None
    if stop is not None:
        if not saved:
            save()
        raise StoppedBySignal(f"stopped by {stop} at the end of epoch {epoch}, step {step:,}: checkpoint written; "
                              "continue with --resume")
    reason = callbacks.agree() if callbacks and epoch < epochs else None  # dist: one answer for every rank
    if reason is not None:
        if not saved:
            save()
        raise StoppedEarly(reason, epoch, step)
    return step


def _mid_epoch_checkpoint(run: Run, config: Config, engine: Engine, store: CheckpointStore, epoch: int, step: int,
                          position: int, sums: EpochSums) -> None:
    """Every rank at the same step: the sums so far reduced over ranks, each rank's random states,
    then rank 0 writes (the others wait for it to say whether it could)."""
    local = torch.stack([torch.as_tensor(sums.loss, dtype=torch.float64).cpu(),
                         torch.tensor(float(sums.samples), dtype=torch.float64),
                         torch.tensor(float(sums.kept), dtype=torch.float64)])
    reduced = engine.allreduce_sum(local, "checkpoint_sums").tolist()  # dist
    share_running_stats(run.model, engine, config.train.dist_bn)
    states = engine.allgather_object(rng_state(), "checkpoint_rng")  # dist: rank r's at index r

    def state() -> tuple[dict[str, Any], int, dict[str, float]]:
        saved = _checkpoint_state(run, config, engine, epoch - 1, step)
        saved.update(position=position, sums=[reduced[0], int(reduced[1]), int(reduced[2]), sums.skipped],
                     rng=states)
        if isinstance(run.train_sampler, StreamBatchSampler):  # where each rank's range stands, for any world size
            saved.update(stream_plan=run.train_sampler.plan_state(position))
        return saved, epoch - 1, {}

    _save_together(engine, store, state, config.run.checkpoint_timeout)


def _save_together(engine: Engine, store: CheckpointStore, make: Callable[[], tuple[dict[str, Any], int, dict]],
                   timeout: float) -> None:
    """Rank 0 writes a checkpoint while every rank waits for it; a failure to write (a full disk) or
    a write slower than `timeout` seconds stops every rank with one line."""
    with engine.agree("checkpoint"):  # dist: the others learn how rank 0's write went
        writer = _Writer(store, make) if engine.is_root else None
        engine.at("waiting for rank 0 to write a checkpoint")
        started = time.monotonic()
        # dist: not one long wait in a collective (the stall watchdog, Horovod's stall inspector and
        # the process group's timeout would each end a healthy job during a slow write) but short
        # ones: every POLL_SECONDS a tiny allreduce of whether rank 0's writer thread is done.
        try:
            while True:
                done = writer.wait(POLL_SECONDS) if writer is not None else False
                late = writer is not None and not done and time.monotonic() - started > timeout
                flags = engine.allreduce_sum(torch.tensor([float(done), float(late)]), "checkpoint_written").tolist()
                if flags[0] or flags[1]:
                    break
        except BaseException:
            if writer is not None:  # another rank was lost meanwhile: not with a write still reading the model
                writer.wait(WRITER_JOIN_SECONDS)
            raise
        if writer is not None:  # the others learn of a failure in the agreement, from rank 0's line
            writer.raise_failure(store, late, timeout)


POLL_SECONDS = 0.5
WRITER_JOIN_SECONDS = 60.0  # how long a failing rank 0 lets its write finish before it goes on


class _Writer:
    """Rank 0's checkpoint write, in a thread of its own so that its main thread can keep telling
    the others it is still writing."""

    def __init__(self, store: CheckpointStore, make: Callable[[], tuple[dict[str, Any], int, dict]]):
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._write, args=(store, make), name="hvdtrain-checkpoint-writer",
                                        daemon=True)  # a write stuck on a dead disk must not hold the exit
        self._thread.start()

    def _write(self, store: CheckpointStore, make: Callable[[], tuple[dict[str, Any], int, dict]]) -> None:
        try:
            state, epoch, metrics = make()
            store.save(state, epoch, metrics)
        except Exception as err:  # noqa: BLE001 - raised in the main thread by raise_failure
            self.error = err

    def wait(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def raise_failure(self, store: CheckpointStore, late: bool, timeout: float) -> None:
        if late:
            raise UserError(f"writing a checkpoint into {store.dir} took longer than run.checkpoint_timeout "
                            f"({timeout:g} s); the checkpoints before it are intact: check that file system, or "
                            "raise run.checkpoint_timeout, then continue with --resume")
        err = self.error
        if isinstance(err, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            reason = err.strerror if isinstance(err, OSError) and err.strerror else message_lines(err)
            raise UserError(f"could not write a checkpoint into {store.dir}: {reason}; the "
                            "checkpoints before it are intact: free space, then continue with --resume") from err
        if err is not None:
            raise err


def finish(config: Config, engine: Engine, run: Run, run_dir: Path, totals: Totals,
           files: RunFiles | None, stopped: StoppedEarly | None = None) -> dict[str, Any]:
    """The run's summary; rank 0 writes summary.json and says how it ended. `stopped`: every rank
    stopped before the last epoch (a callback, early stopping), with why and where."""
    record = totals.record or {}
    epochs = record.get("epoch", totals.start_epoch) if stopped else config.train.epochs
    key, higher = run.best
    summary = {
        "world_size": engine.size, "epochs": epochs, "steps": record.get("step"), "task": run.task.name,
        **{name: value for name, value in record.items() if name.startswith("val_")},
        "train_loss": record.get("train_loss"), "best_metric": key,
        "train_samples_per_s": totals.train_samples / totals.train_seconds if totals.train_seconds else None,
        "wall_s": time.perf_counter() - totals.started,
        "engine": engine.name, "controller": engine.controller, "device": str(engine.device),
        "resumed_from_epoch": totals.start_epoch or None,
    }
    if stopped:
        summary.update(stopped=stopped.reason, stopped_at_epoch=stopped.epoch, stopped_at_step=stopped.step,
                       planned_epochs=config.train.epochs)
    if files is not None:
        best = files.best_record(key, higher)  # over every epoch recorded, a resumed run's too
        summary.update(best_value=best.get(key), best_epoch=best.get("epoch"))
        files.write_summary(summary)
        files.close()
        if stopped:
            inside = "" if record.get("step") == stopped.step else " (inside it: --resume continues there)"
            say(f"hvdtrain: stopped: {stopped.reason}; at epoch {stopped.epoch}, step {stopped.step:,}{inside}")
        if record:
            best_text = f" (best {best[key]:.4f} at epoch {best['epoch']})" if best else ""
            say(f"hvdtrain: done: {key} {record[key]:.4f} after {epochs} epochs{best_text}; "
                f"results in {run_dir}/summary.json")
        elif not stopped:
            say(f"hvdtrain: nothing to do: {run_dir} already finished {epochs} epochs")
    return summary


def _checkpoint_state(run: Run, config: Config, engine: Engine, epoch: int, step: int) -> dict[str, Any]:
    return {
        "model": unwrapped(run.model).state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "world_size": engine.size,
        "lr_batch": run.learning_rate.lr_batch,
        "scaler": run.precision.state_dict(),
        "task": run.task.name,
        "shapes": run.shapes.to_dict(),  # what `evaluate`, `predict` and `export` rebuild the model from
        "config": config.to_dict(),
    }


def _seed(seed: int, epoch: int, rank: int) -> None:
    # Per epoch and rank, so dropout and augmentation (torch's, numpy's or Python's, in this process)
    # replay exactly after a resume.
    seed_generators(seed * 1_000_003 + epoch * 1_009 + rank)

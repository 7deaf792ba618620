"""`fit`: builds the run from a config and drives the loop on a given engine.

    horovodrun -np 2 hvdtrain fit             # two processes, Gloo or MPI
    mpirun -np 2 hvdtrain fit                 # the same through plain MPI
    hvdtrain fit                              # one process, no launcher needed

From Python: `fit(Config(), start_engine())`. The engine is an argument so the same
code runs on Horovod, on one local process, and in tests.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from hvdtrain.batch import to_device
from hvdtrain.checkpoint import CheckpointStore
from hvdtrain.config import Config
from hvdtrain.data import DataSplit, batches, build_data, collate_function, data_workers
from hvdtrain.engine import Engine, GradientSync, RankFailed
from hvdtrain.errors import FailedAt, UserError, message_lines, where
from hvdtrain.event_log import EventLog, StepLog
from hvdtrain.loop import evaluate, train_epoch
from hvdtrain.models import ModelShapes
from hvdtrain.precision import Precision
from hvdtrain.progress import EpochProgress, bar_stream, epoch_line, say
from hvdtrain.run_dir import TIMELINE, RunFiles, prepare_run_dir
from hvdtrain.sampler import EvalShardSampler, ShardedBatchSampler
from hvdtrain.schedule import LearningRate
from hvdtrain.tasks import Task, build_task
from hvdtrain.tasks.check import FirstBatch, best_metric, check_first_batch


@dataclass
class Run:
    """Everything built during set-up, identical in shape on every rank."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    task: Task
    split: DataSplit
    precision: Precision
    run_dir: Path | None  # rank 0 only
    shapes: ModelShapes
    workers: int = 0
    collate: Any = None
    # Set by `check_task`:
    first: FirstBatch | None = None
    best: tuple[str, bool] = ("val_loss", False)
    """(record key of run.best_metric, whether higher is better)."""
    # Set by `shard`, again whenever the world size changes (elastic training):
    train_sampler: ShardedBatchSampler | None = None
    train_batches: Any = None
    val_batches: Any = None
    learning_rate: LearningRate | None = None
    step_log: StepLog | None = None


def fit(config: Config, engine: Engine) -> dict[str, Any]:
    """Trains as the config says; returns the summary (also in summary.json)."""
    started = time.perf_counter()
    sys.stderr.write(f"hvdtrain: {engine.describe()}\n")  # every rank, once; one write keeps it whole
    sys.stderr.flush()
    if config.train.elastic:
        from hvdtrain.elastic import fit_elastic

        return fit_elastic(config, engine, started)

    with engine.agree("setup"):  # dist: a failure on any rank stops all of them here
        if config.run.horovod_timeline:
            engine.require_timeline()
        run = build(config, engine)
        shard(run, config, engine)
        check_task(run, config, engine)
    with engine.agree("data"):
        check_same_data(engine, run)
    with engine.agree("resume"):
        start_epoch, step = start_on_root(config, engine, run)
    run_dir = Path(engine.broadcast_object(str(run.run_dir) if engine.is_root else None, "run_dir"))
    # dist: every rank starts from rank 0's weights and optimizer state.
    engine.broadcast_parameters(run.model)
    engine.broadcast_optimizer_state(run.optimizer)
    start_epoch, step = engine.broadcast_object((start_epoch, step), "start")

    totals = Totals(started, start_epoch)
    files = open_run_files(config, engine, run, run_dir, start_epoch, step)
    store = CheckpointStore(run_dir, config.run.keep_last, *run.best)
    stream = bar_stream(config.run.progress) if engine.is_root else None  # dist: rank 0 only
    if config.run.horovod_timeline:
        engine.start_timeline(run_dir / TIMELINE)
    for epoch in range(start_epoch + 1, config.train.epochs + 1):
        step = run_epoch(run, config, engine, epoch, step, totals, files, store, stream)
    if config.run.horovod_timeline:
        engine.stop_timeline()
    return finish(config, engine, run, run_dir, totals, files)


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
    events = EventLog(run_dir, resumed_at_step=start_step) if config.run.tensorboard else None
    files = RunFiles(run_dir, events)
    files.write_config(config.to_dict())
    files.truncate_metrics(after_epoch=start_epoch)
    say(f"hvdtrain: run directory {run_dir}  (world size {engine.size}, "
        f"global batch {run.train_sampler.global_batch * config.train.accumulate}, "
        f"{len(run.train_sampler)} batches per rank per epoch)")
    return files


def run_epoch(run: Run, config: Config, engine: Engine, epoch: int, step: int, totals: Totals,
              files: RunFiles | None, store: CheckpointStore, stream: Any, *, start: int = 0,
              after_step: Callable[[int], None] | None = None) -> int:
    """Trains one epoch (from global position `start`), evaluates, and on rank 0 records it
    and checkpoints. Returns the next step number."""
    _seed(config.train.seed, epoch, engine.rank)
    run.train_sampler.set_epoch(epoch, start)  # dist: a new shuffle, the same on every rank
    epochs = config.train.epochs
    progress = EpochProgress(stream, epoch, epochs, len(run.train_sampler) // config.train.accumulate, step)

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

    engine.at(f"epoch {epoch}, training from step {step}")
    epoch_start = time.perf_counter()
    try:
        train, step = train_epoch(
            run.model, run.optimizer, engine, run.task, run.train_batches,
            first_step=step, learning_rate=run.learning_rate, accumulate=config.train.accumulate,
            clip_grad_norm=config.optim.clip_grad_norm, precision=run.precision,
            channels_last=config.train.channels_last, nonfinite=config.train.nonfinite, on_step=on_step,
        )
        seconds = time.perf_counter() - epoch_start
        progress.close()
        engine.at(f"epoch {epoch}, evaluation")
        position[0] = f"epoch {epoch}, evaluation"
        val = evaluate(run.model, engine, run.task, run.val_batches, run.first.template, run.precision,
                       config.train.channels_last)
    except Exception as err:
        raise _located(err, engine, position[0])
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
        if epoch % config.run.checkpoint_every == 0 or epoch == epochs:
            store.save(_checkpoint_state(run, config, engine, epoch, step), epoch, metrics)
    return step


def _located(err: Exception, engine: Engine, position: str) -> Exception:
    """The user's code failed mid-run on this rank (a Dataset, the model, the task): one line
    naming the rank, where in the run, and where in their code. Other failures pass as they are."""
    if isinstance(err, (UserError, RankFailed)) or engine.is_engine_signal(err):
        return err
    located = FailedAt(f"rank {engine.rank} failed at {position}: {type(err).__name__}: {message_lines(err)}{where(err)}; "
                       "every rank stops (--debug shows the traceback)")
    located.__cause__ = err
    return located


def finish(config: Config, engine: Engine, run: Run, run_dir: Path, totals: Totals,
           files: RunFiles | None) -> dict[str, Any]:
    """The run's summary; rank 0 writes summary.json and says how it ended."""
    record = totals.record or {}
    epochs = config.train.epochs
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
    if files is not None:
        best = files.best_record(key, higher)  # over every epoch recorded, a resumed run's too
        summary.update(best_value=best.get(key), best_epoch=best.get("epoch"))
        files.write_summary(summary)
        files.close()
        if record:
            best_text = f" (best {best[key]:.4f} at epoch {best['epoch']})" if best else ""
            say(f"hvdtrain: done: {key} {record[key]:.4f} after {epochs} epochs{best_text}; "
                f"results in {run_dir}/summary.json")
        else:
            say(f"hvdtrain: nothing to do: {run_dir} already finished {epochs} epochs")
    return summary


def build(config: Config, engine: Engine) -> Run:
    """Data, model and optimizer; no collectives, no files."""
    torch.manual_seed(config.train.seed)  # the same initial weights everywhere, broadcast anyway
    task = build_task(config.task)
    split: DataSplit = build_data(config.data, config.train.seed, task.target_key)
    task.check_data(split.target_dtype, split.target_shape)
    shapes = ModelShapes(split.input_shape, split.num_classes, task.num_outputs(split.num_classes, split.target_shape))
    model = shapes.build(config.model).to(engine.device)
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = engine.wrap_optimizer(
        _make_optimizer(config, model), model,
        GradientSync(config.train.accumulate, config.train.compression, config.train.adasum),
    )
    # Compiled after wrapping: Horovod's hooks sit on the parameters, which compiling keeps.
    forward = torch.compile(model) if config.train.compile else model
    return Run(forward, optimizer, task, split, Precision(config.train.precision, engine.device), None, shapes,
               workers=data_workers(config.data.num_workers, split.train, engine),
               collate=collate_function(config.data.collate, config.task.ignore_index, task.target_key))


def shard(run: Run, config: Config, engine: Engine) -> None:
    """This rank's batches and the learning rate for the current world size."""
    batch, accumulate = config.data.batch_size, config.train.accumulate
    train_size = len(run.split.train)
    # dist: each rank takes its slice of every global batch; the same count on every rank.
    run.train_sampler = ShardedBatchSampler(train_size, batch, engine.rank, engine.size,
                                            seed=config.train.seed, multiple=accumulate)
    if len(run.train_sampler) == 0:
        raise UserError(
            f"the training set has {train_size} samples, fewer than one optimizer step needs "
            f"(batch {batch} x {engine.size} processes x accumulate {accumulate}): "
            "lower --batch-size or --accumulate, or use fewer processes"
        )
    val_sampler = EvalShardSampler(len(run.split.val), batch, engine.rank, engine.size)
    pin = engine.device.type == "cuda"  # pinned host memory lets copies to the GPU overlap compute
    run.train_batches = batches(run.split.train, run.train_sampler, run.workers, pin, run.collate)
    run.val_batches = batches(run.split.val, val_sampler, run.workers, pin, run.collate)
    run.step_log = StepLog(engine, config.run.log_every, batch * accumulate)
    run.learning_rate = LearningRate.from_config(
        config.optim, world_size=engine.size, accumulate=accumulate, adasum=config.train.adasum,
        steps_per_epoch=len(run.train_sampler) // accumulate, epochs=config.train.epochs,
    )


def check_task(run: Run, config: Config, engine: Engine) -> None:
    """The task and model on one batch before training (no collectives): labels that the model
    cannot score, a loss that is not a finite scalar, metrics that are not sums and counts."""
    size = min(config.data.batch_size, len(run.split.train))
    first = next(iter(batches(run.split.train, [list(range(size))], 0, False, run.collate)))
    first = to_device(first, engine.device, config.train.channels_last)
    run.first = check_first_batch(run.task, run.model, first, run.split.held_targets, run.precision)
    run.best = best_metric(config.run.best_metric, config.run.best_mode, run.task, run.first.reported)


def check_same_data(engine: Engine, run: Run) -> None:
    """Every rank must see the same data set, or ranks would wait on each other forever.

    Each rank builds the data itself (a factory may read per-host files); the batch
    counts follow from the sizes (the rest of the config is the same everywhere), and a
    rank with more batches would wait in an allreduce that the others never join.
    """
    everyone = engine.allgather_object((len(run.split.train), len(run.split.val)), "data_sizes")  # dist
    if len(set(everyone)) > 1:
        listed = ", ".join(f"rank {r}: {train} train / {val} val" for r, (train, val) in enumerate(everyone))
        raise UserError(f"ranks built data sets of different sizes ({listed}): every rank must build the same "
                        "data set; hvdtrain shards it by rank itself, so do not shard it in your factory")


def _make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    cfg = config.optim
    if cfg.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def start_on_root(config: Config, engine: Engine, run: Run) -> tuple[int, int]:
    """On rank 0, after every check passed: the run directory, and the checkpoint when
    resuming. Returns (epoch done, step); (0, 0) elsewhere."""
    if not engine.is_root:  # dist: rank 0 alone owns the run directory
        return 0, 0
    run.run_dir = prepare_run_dir(config.run)
    return _restore(config, run, run.run_dir) if config.run.resume else (0, 0)


def _restore(config: Config, run: Run, run_dir: Path) -> tuple[int, int]:
    """Loads the newest intact checkpoint into the model and optimizer."""
    path = CheckpointStore(run_dir).latest_valid(warn=lambda message: say(f"hvdtrain: warning: {message}"))
    if path is None:
        raise UserError(f"no intact checkpoint to resume in '{run_dir}/checkpoints': every one is corrupt or "
                        "missing; start a new run with --overwrite or another --run-dir")
    state = CheckpointStore.load(path)
    try:
        _unwrapped(run.model).load_state_dict(state["model"])
    except RuntimeError as err:
        raise UserError(f"checkpoint '{path}' does not fit this model: {message_lines(err, 3)}; "
                        "resume with the model settings it was written with") from err
    try:
        run.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as err:
        raise UserError(f"checkpoint '{path}' has optimizer state that does not fit optim.name "
                        f"'{config.optim.name}': {err}") from err
    run.precision.load_state_dict(state.get("scaler", {}))
    say(f"hvdtrain: resuming from {path} (epoch {state['epoch']}, step {state['step']})")
    return int(state["epoch"]), int(state["step"])


def _checkpoint_state(run: Run, config: Config, engine: Engine, epoch: int, step: int) -> dict[str, Any]:
    return {
        "model": _unwrapped(run.model).state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "world_size": engine.size,
        "scaler": run.precision.state_dict(),
        "task": run.task.name,
        "shapes": run.shapes.to_dict(),  # what `evaluate`, `predict` and `export` rebuild the model from
        "config": config.to_dict(),
    }


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module itself, without torch.compile's wrapper (checkpoints keep plain names)."""
    return getattr(model, "_orig_mod", model)


def _seed(seed: int, epoch: int, rank: int) -> None:
    # Per epoch and rank, so dropout and augmentation replay exactly after a resume.
    torch.manual_seed(seed * 1_000_003 + epoch * 1_009 + rank)

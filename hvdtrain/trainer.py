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
from typing import Any

import torch
from torch import nn

from hvdtrain.checkpoint import CheckpointStore
from hvdtrain.config import Config
from hvdtrain.data import DataSplit, batches, build_data, data_workers
from hvdtrain.engine import Engine, GradientSync
from hvdtrain.errors import UserError
from hvdtrain.loop import evaluate, train_epoch
from hvdtrain.models import build_model
from hvdtrain.precision import Precision
from hvdtrain.progress import EpochProgress, bar_stream, epoch_line, say
from hvdtrain.run_dir import RunFiles, prepare_run_dir
from hvdtrain.sampler import EvalShardSampler, ShardedBatchSampler
from hvdtrain.schedule import LearningRate


@dataclass
class Run:
    """Everything built during set-up, identical in shape on every rank."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_sampler: ShardedBatchSampler
    train_batches: Any
    val_batches: Any
    learning_rate: LearningRate
    precision: Precision
    val_size: int
    run_dir: Path | None  # rank 0 only


def fit(config: Config, engine: Engine) -> dict[str, Any]:
    """Trains as the config says; returns the summary (also in summary.json)."""
    started = time.perf_counter()
    sys.stderr.write(f"hvdtrain: {engine.describe()}\n")  # every rank, once; one write keeps it whole
    sys.stderr.flush()

    with engine.agree("setup"):  # dist: a failure on any rank stops all of them here
        run = _build(config, engine)
    with engine.agree("data"):
        _check_same_data(engine, run)
    run_dir = Path(engine.broadcast_object(str(run.run_dir) if engine.is_root else None, "run_dir"))

    with engine.agree("resume"):
        start_epoch, step = _restore(config, engine, run, run_dir)
    # dist: every rank starts from rank 0's weights and optimizer state.
    engine.broadcast_parameters(run.model)
    engine.broadcast_optimizer_state(run.optimizer)
    start_epoch, step = engine.broadcast_object((start_epoch, step), "start")

    files = RunFiles(run_dir) if engine.is_root else None  # dist: rank 0 writes shared files
    if files is not None:
        files.write_config(config.to_dict())
        files.truncate_metrics(after_epoch=start_epoch)
        say(f"hvdtrain: run directory {run_dir}  (world size {engine.size}, "
            f"global batch {run.train_sampler.global_batch * config.train.accumulate}, "
            f"{len(run.train_sampler)} batches per rank per epoch)")

    store = CheckpointStore(run_dir, config.run.keep_last, config.run.best_metric)
    epochs = config.train.epochs
    record: dict[str, Any] = {}
    train_seconds, train_samples = 0.0, 0
    stream = bar_stream(config.run.progress) if engine.is_root else None  # dist: rank 0 only
    for epoch in range(start_epoch + 1, epochs + 1):
        _seed(config.train.seed, epoch, engine.rank)
        run.train_sampler.set_epoch(epoch)  # dist: a new shuffle, the same on every rank
        progress = EpochProgress(stream, epoch, epochs,
                                 len(run.train_sampler) // config.train.accumulate, step)
        epoch_start = time.perf_counter()
        train, step = train_epoch(
            run.model, run.optimizer, engine, run.train_batches,
            first_step=step, learning_rate=run.learning_rate, accumulate=config.train.accumulate,
            clip_grad_norm=config.optim.clip_grad_norm, precision=run.precision,
            channels_last=config.train.channels_last, nonfinite=config.train.nonfinite, on_step=progress.step,
        )
        seconds = time.perf_counter() - epoch_start
        progress.close()
        val = evaluate(run.model, engine, run.val_batches, run.precision, config.train.channels_last)
        train_seconds += seconds
        train_samples += train.samples
        record = {
            "epoch": epoch, "epochs": epochs, "step": step,
            "train_loss": train.loss, "val_loss": val.loss, "val_acc": val.accuracy,
            "val_samples": val.samples, "train_samples": train.samples, "skipped_steps": train.skipped_steps,
            "train_samples_per_s": train.samples / seconds, "lr": run.learning_rate(step),
            "elapsed_s": time.perf_counter() - started,
        }
        if files is not None:
            files.append_metrics(record)
            say(epoch_line(record))
            if epoch % config.run.checkpoint_every == 0 or epoch == epochs:
                store.save(_checkpoint_state(run, config, engine, epoch, step), epoch,
                           {"val_acc": val.accuracy, "val_loss": val.loss})

    summary = {
        "world_size": engine.size, "epochs": epochs, "steps": step,
        "val_acc": record.get("val_acc"), "val_loss": record.get("val_loss"),
        "train_loss": record.get("train_loss"),
        "train_samples_per_s": train_samples / train_seconds if train_seconds else None,
        "wall_s": time.perf_counter() - started,
        "controller": engine.controller, "device": str(engine.device),
        "resumed_from_epoch": start_epoch or None,
    }
    if files is not None:
        files.write_summary(summary)
        if record:
            say(f"hvdtrain: done: val_acc {record['val_acc']:.4f} after {epochs} epochs; "
                f"results in {run_dir}/summary.json")
        else:
            say(f"hvdtrain: nothing to do: {run_dir} already finished {epochs} epochs")
    return summary


def _build(config: Config, engine: Engine) -> Run:
    torch.manual_seed(config.train.seed)  # the same initial weights everywhere, broadcast anyway
    split: DataSplit = build_data(config.data, config.train.seed)
    model = build_model(config.model, split.input_shape, split.num_classes).to(engine.device)
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    batch = config.data.batch_size
    accumulate = config.train.accumulate
    # dist: each rank takes its slice of every global batch; the same count on every rank.
    train_sampler = ShardedBatchSampler(len(split.train), batch, engine.rank, engine.size,
                                        seed=config.train.seed, multiple=accumulate)
    if len(train_sampler) == 0:
        raise UserError(
            f"the training set has {len(split.train)} samples, fewer than one optimizer step needs "
            f"(batch {batch} x {engine.size} processes x accumulate {accumulate}): "
            "lower --batch-size or --accumulate, or use fewer processes"
        )
    val_sampler = EvalShardSampler(len(split.val), batch, engine.rank, engine.size)
    pin = engine.device.type == "cuda"  # pinned host memory lets copies to the GPU overlap compute
    workers = data_workers(config.data.num_workers, split.train, engine)
    optimizer = engine.wrap_optimizer(
        _make_optimizer(config, model), model,
        GradientSync(accumulate, config.train.compression, config.train.adasum),
    )
    learning_rate = LearningRate.from_config(
        config.optim, world_size=engine.size, accumulate=accumulate, adasum=config.train.adasum,
        steps_per_epoch=len(train_sampler) // accumulate, epochs=config.train.epochs,
    )
    run_dir = prepare_run_dir(config.run) if engine.is_root else None  # dist: rank 0 only
    # Compiled after wrapping: Horovod's hooks sit on the parameters, which compiling keeps.
    forward = torch.compile(model) if config.train.compile else model
    return Run(forward, optimizer, train_sampler,
               batches(split.train, train_sampler, workers, pin),
               batches(split.val, val_sampler, workers, pin),
               learning_rate, Precision(config.train.precision, engine.device), len(split.val), run_dir)


def _check_same_data(engine: Engine, run: Run) -> None:
    """Every rank must see the same data set, or ranks would wait on each other forever.

    Each rank builds the data itself (a factory may read per-host files); the batch
    counts follow from the sizes (the rest of the config is the same everywhere), and a
    rank with more batches would wait in an allreduce that the others never join.
    """
    everyone = engine.allgather_object((run.train_sampler.n, run.val_size), "data_sizes")  # dist
    if len(set(everyone)) > 1:
        listed = ", ".join(f"rank {r}: {train} train / {val} val" for r, (train, val) in enumerate(everyone))
        raise UserError(f"ranks built data sets of different sizes ({listed}): every rank must build the same "
                        "data set; hvdtrain shards it by rank itself, so do not shard it in your factory")


def _make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    cfg = config.optim
    if cfg.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _restore(config: Config, engine: Engine, run: Run, run_dir: Path) -> tuple[int, int]:
    """On rank 0: loads the newest checkpoint when resuming. Returns (epoch done, step)."""
    if not (config.run.resume and engine.is_root):
        return 0, 0
    path = CheckpointStore(run_dir).latest_valid(warn=lambda message: say(f"hvdtrain: warning: {message}"))
    if path is None:
        raise UserError(f"no intact checkpoint to resume in '{run_dir}/checkpoints': every one is corrupt or "
                        "missing; start a new run with --overwrite or another --run-dir")
    state = CheckpointStore.load(path)
    try:
        _unwrapped(run.model).load_state_dict(state["model"])
    except RuntimeError as err:
        raise UserError(f"checkpoint '{path}' does not fit this model: {_first_line(err)}; "
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
        "config": config.to_dict(),
    }


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module itself, without torch.compile's wrapper (checkpoints keep plain names)."""
    return getattr(model, "_orig_mod", model)


def _seed(seed: int, epoch: int, rank: int) -> None:
    # Per epoch and rank, so dropout and augmentation replay exactly after a resume.
    torch.manual_seed(seed * 1_000_003 + epoch * 1_009 + rank)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return " ".join(line.strip() for line in text[:3])

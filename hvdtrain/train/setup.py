"""What plain and elastic `fit` build before the first epoch: data, model, optimizer (`build`),
this rank's batches and learning rate for the current world size (`shard`), the checks of the
task on one batch and of the data across ranks, and the run directory or checkpoint on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.config import Config
from hvdtrain.config.schema import signal_numbers
from hvdtrain.data import mapped
from hvdtrain.data.batch import to_device
from hvdtrain.data.loading import batches, collate_function, data_workers
from hvdtrain.data.sampler import EvalShardSampler, ShardedBatchSampler
from hvdtrain.data.stream_sampler import StreamBatchSampler, training_sampler
from hvdtrain.data.streams import StreamDataset
from hvdtrain.data.sources import DataSplit, build_data
from hvdtrain.engine import Engine, GradientSync
from hvdtrain.errors import UserError, message_lines
from hvdtrain.factory import call_factory
from hvdtrain.io.checkpoint import CheckpointStore
from hvdtrain.io.event_log import StepLog
from hvdtrain.io.progress import say
from hvdtrain.io.run_dir import prepare_run_dir
from hvdtrain.models import ModelShapes
from hvdtrain.tasks import Task, build_task
from hvdtrain.tasks.check import FirstBatch, best_metric, check_first_batch
from hvdtrain.numerics.precision import Precision
from hvdtrain.train.schedule import LearningRate


@dataclass
class Start:
    """Where training begins: `epoch` whole epochs done, then `position` samples into the next one's
    order (0: at its start). A mid-epoch checkpoint also gives the epoch's sums so far, reduced over
    ranks, and each rank's random states."""

    epoch: int = 0
    step: int = 0
    position: int = 0
    sums: tuple[float, int, int, int] = (0.0, 0, 0, 0)
    rng: list[dict[str, Any]] | None = None
    world_size: int = 0
    lr_batch: int = 0
    """The global batch the run's lr is for (0: a fresh run, the config's)."""
    stream_plan: dict[str, Any] | None = None
    """Of a stream stopped inside an epoch: what its sampler needs to go on (`StreamBatchSampler.plan_state`)."""


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
    workers: tuple[int, int] = (0, 0)
    """DataLoader workers of the training and the validation loader (one budget, data.num_workers)."""
    collate: Any = None
    # Set by `check_task`:
    first: FirstBatch | None = None
    best: tuple[str, bool] = ("val_loss", False)
    """(record key of run.best_metric, whether higher is better)."""
    # Set by `shard`, again whenever the world size changes (elastic training):
    train_sampler: ShardedBatchSampler | StreamBatchSampler | None = None
    train_batches: Any = None
    val_batches: Any = None
    learning_rate: LearningRate | None = None
    step_log: StepLog | None = None


def build(config: Config, engine: Engine) -> Run:
    """Data, model and optimizer; no collectives, no files."""
    torch.manual_seed(config.train.seed)  # the same initial weights everywhere, broadcast anyway
    task = build_task(config.task)
    if mapped.is_token_file(config.data.name):
        mapped.check_token_run(config.data.name, config.task.name, config.model.name)
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
    run.train_sampler = train_sampler(run.split.train, config, engine.rank, engine.size, run.workers[0])
    if len(run.train_sampler) == 0:
        raise UserError(
            f"the training set has {train_size} samples, fewer than one optimizer step needs "
            f"(batch {batch} x {engine.size} processes x accumulate {accumulate}): "
            "lower --batch-size or --accumulate, or use fewer processes"
        )
    val_sampler = EvalShardSampler(len(run.split.val), batch, engine.rank, engine.size)
    pin = engine.device.type == "cuda"  # pinned host memory lets copies to the GPU overlap compute
    stop = tuple(signal_numbers(config.run.stop_signals))
    run.train_batches = batches(run.split.train, run.train_sampler, run.workers[0], pin, run.collate, stop)
    run.val_batches = batches(run.split.val, val_sampler, run.workers[1], pin, run.collate, stop)
    run.step_log = StepLog(engine, config.run.log_every, batch * accumulate)
    run.learning_rate = LearningRate.from_config(
        config.optim, global_batch=run.train_sampler.global_batch * accumulate, batch_size=batch,
        adasum=config.train.adasum, steps_per_epoch=len(run.train_sampler) // accumulate, epochs=config.train.epochs,
    )


def train_sampler(dataset: Dataset, config: Config, rank: int, size: int,
                  workers: int) -> ShardedBatchSampler | StreamBatchSampler:
    return training_sampler(dataset, config.data.batch_size, rank, size, seed=config.train.seed,
                            multiple=config.train.accumulate, buffer=config.data.shuffle_buffer, workers=workers)


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
    train = run.split.train
    shards = engine.allgather_object(train.fingerprint() if isinstance(train, StreamDataset) else None, "shards")
    if len(set(shards)) > 1:  # dist: a position must be the same sample everywhere, or some are read twice
        differs = next(r for r, seen in enumerate(shards) if seen != shards[0])
        raise UserError(f"ranks 0 and {differs} see different shards, or shards of different sizes, under "
                        f"'{run.split.train.source.names()[0]}'...: every rank must read the same shards (the same "
                        "files, or exact copies)")


def _make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    cfg = config.optim
    if cfg.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        # Decay the weights of matrices and kernels only: biases and norm scales (fewer than 2
        # dimensions) are not decayed, as in BERT's and GPT's recipes.
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr)
    made = call_factory(cfg.name, "optimizer", {"model": model, "lr": cfg.lr})
    if not isinstance(made, torch.optim.Optimizer):
        raise UserError(f"optimizer factory '{cfg.name}' returned {type(made).__name__}: return a "
                        "torch.optim.Optimizer over the model's parameters")
    for group in made.param_groups:  # each group follows the schedule at its own ratio to optim.lr
        group.setdefault("lr_ratio", group["lr"] / cfg.lr)
    return made


def start_on_root(config: Config, engine: Engine, run: Run) -> Start:
    """On rank 0, after every check passed: the run directory, and the checkpoint when
    resuming. Returns where training begins; the beginning elsewhere."""
    if not engine.is_root:  # dist: rank 0 alone owns the run directory
        return Start()
    run.run_dir, resuming = prepare_run_dir(config.run)
    return _restore(config, run, run.run_dir) if resuming else Start()


def _restore(config: Config, run: Run, run_dir: Path) -> Start:
    """Loads the newest intact checkpoint into the model and optimizer."""
    path = CheckpointStore(run_dir).latest_valid(warn=lambda message: say(f"hvdtrain: warning: {message}"))
    if path is None:
        raise UserError(f"no intact checkpoint to resume in '{run_dir}/checkpoints': every one is corrupt or "
                        "missing; start a new run with --overwrite or another --run-dir")
    state = CheckpointStore.load(path)
    written_by = state.get("task")
    if written_by and written_by != run.task.name:  # the same shapes can still mean another loss and metrics
        raise UserError(f"checkpoint '{path}' was written by task '{written_by}', and this run's task is "
                        f"'{run.task.name}': resume with --task {written_by}, or start a new run in another --run-dir")
    try:
        unwrapped(run.model).load_state_dict(state["model"])
    except RuntimeError as err:
        raise UserError(f"checkpoint '{path}' does not fit this model: {message_lines(err, 3)}; "
                        "resume with the model settings it was written with") from err
    try:
        run.optimizer.load_state_dict(_adamw_groups_split(state["optimizer"], run.optimizer, config, run.model))
    except (ValueError, KeyError) as err:
        raise UserError(f"checkpoint '{path}' has optimizer state that does not fit optim.name "
                        f"'{config.optim.name}': {err}") from err
    run.precision.load_state_dict(state.get("scaler", {}))
    position = int(state.get("position", 0))
    inside = f", {position} samples into epoch {state['epoch'] + 1}" if position else ""
    say(f"hvdtrain: resuming from {path} (epoch {state['epoch']}, step {state['step']}{inside})")
    sums = state.get("sums", (0.0, 0, 0, 0))
    # Checkpoints from before optim.lr_batch: their lr was for one process's batch.
    lr_batch = state.get("lr_batch") or state.get("config", {}).get("data", {}).get("batch_size", 0)
    return Start(int(state["epoch"]), int(state["step"]), position, tuple(sums), state.get("rng"),
                 int(state.get("world_size", 0)), int(lr_batch), state.get("stream_plan"))


def _adamw_groups_split(saved: dict[str, Any], optimizer: torch.optim.Optimizer, config: Config,
                        model: nn.Module) -> dict[str, Any]:
    """An AdamW checkpoint from before biases and norm scales got a group of their own (one group of
    every parameter in the model's order), split as `_make_optimizer` groups them now."""
    groups = saved.get("param_groups", [])
    if config.optim.name != "adamw" or len(groups) != 1 or len(optimizer.param_groups) == 1:
        return saved
    dims = [p.dim() for p in unwrapped(model).parameters()]
    if len(groups[0]["params"]) != len(dims):
        return saved  # not this model's: load_state_dict says so
    old = groups[0]
    split = [{**old, "params": [i for i, d in zip(old["params"], dims) if d >= 2]},
             {**old, "weight_decay": 0.0, "params": [i for i, d in zip(old["params"], dims) if d < 2]}]
    return {**saved, "param_groups": [g for g in split if g["params"]]}


def keep_learning_rate(config: Config, lr_batch: int) -> None:
    """A resumed run keeps the global batch its lr was for (unless optim.lr_batch is set): on another
    number of processes with the same global batch the learning rate stays the same."""
    if lr_batch and config.optim.lr_batch is None:
        config.optim.lr_batch = lr_batch


def unwrapped(model: nn.Module) -> nn.Module:
    """The module itself, without torch.compile's wrapper (checkpoints keep plain names)."""
    return getattr(model, "_orig_mod", model)

"""What plain and elastic `fit` build before the first epoch: data, model, optimizer (`build`),
this rank's batches for the current world size (`shard`), the learning rate for it, and the checks
of the task on one batch and of the data across ranks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.config import Config
from hvdtrain.config.schema import signal_numbers
from hvdtrain.data import mapped
from hvdtrain.data.augment import prepared_batches
from hvdtrain.data.loading import (batches, collate_function, data_workers, end_workers, first_batch,
                                   seeded_for_data)
from hvdtrain.data.sampler import EvalShardSampler, TrainingSampler
from hvdtrain.data.stream_sampler import training_sampler
from hvdtrain.data.streams import StreamDataset
from hvdtrain.data.sources import DataSplit, build_data
from hvdtrain.engine import Engine, GradientSync
from hvdtrain.errors import UserError
from hvdtrain.factory import call_factory, unstarted_library
from hvdtrain.io.progress import mib
from hvdtrain.models import DATA_PARALLEL, ModelShapes, unwrapped
from hvdtrain.tasks import BUILT_IN as BUILT_IN_TASKS, Task, build_task
from hvdtrain.tasks.check import FirstBatch, best_metric, check_first_batch
from hvdtrain.numerics.precision import Precision
from hvdtrain.same_samples import check_same_samples
from hvdtrain.train.lazy_modules import make_lazy_weights
from hvdtrain.train.loggers import warn
from hvdtrain.train.random_state import rng_state, set_rng_state
from hvdtrain.train.sparse_gradients import densify_sparse_gradients
from hvdtrain.train.steps import StepCount


@dataclass(frozen=True)
class Run:
    """What set-up builds, identical in shape on every rank, for any number of processes."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    task: Task
    split: DataSplit
    precision: Precision
    shapes: ModelShapes
    workers: tuple[int, int] = (0, 0)
    """DataLoader workers of the training and the validation loader (one budget, data.num_workers)."""
    collate: Any = None


@dataclass(frozen=True)
class Shard:
    """This rank's part of the data for the current world size (made again when it changes: elastic training)."""

    sampler: TrainingSampler
    train_batches: Any
    val_batches: Any
    steps: StepCount
    loaders: tuple[Any, ...] = ()
    """What the batches come from (the DataLoaders, with their workers)."""

    def end_workers(self, at_once: bool = False) -> None:
        """Ends the loaders' worker processes (training can't go on with this shard after); `at_once`:
        killed, not waited for."""
        try:
            for loader in self.loaders:
                end_workers(loader, at_once)
        finally:  # a Ctrl-C cut one short: the others' are killed (a loader whose workers ended has none left)
            for loader in self.loaders:
                end_workers(loader, at_once=True)


@dataclass(frozen=True)
class MadeData:
    """The task and data as `build` begins, made ahead of it (`make_data`), and the random states right
    after: `build` goes on from them, as from data it had made itself (a factory that draws changes nothing)."""

    task: Task
    split: DataSplit
    random_state: dict[str, Any]


def make_data(config: Config) -> MadeData:
    """The task and the data set; no collectives, no files but the data's own."""
    task = build_task(config.task)
    if mapped.is_token_file(config.data.name):
        mapped.check_token_run(config.data.name, config.task.name, config.model.name)
    seeded_for_data(config.train.seed)  # then the model: the same initial weights everywhere, broadcast anyway
    split: DataSplit = build_data(config.data, config.train.seed, task.target_key)
    return MadeData(task, split, rng_state())


def build(config: Config, engine: Engine, made: MadeData | None = None) -> Run:
    """Data (or what `make_data` `made` of it before), model and optimizer; no collectives, no files."""
    if made is None:
        made = make_data(config)
    else:
        set_rng_state(made.random_state)
    task, split = made.task, made.split
    _refuse_raw_samples(split, config)
    task.check_data(split.target_dtype, split.target_shape)
    shapes = ModelShapes(split.input_shape, split.num_classes, task.num_outputs(split.num_classes, split.target_shape))
    model = _module_to_train(shapes.build(config.model), config, engine.rank).to(engine.device)
    collate = collate_function(config.data.collate, config.task.ignore_index, task.target_key)
    precision = Precision(config.train.precision, engine.device)
    make_lazy_weights(model, task, split.train, collate, engine.device, precision.autocast())
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    densify_sparse_gradients(model)
    train = config.train
    _refuse_complex_weights_on_a_real_wire(model, train.compression, train.shard_optimizer)
    optimizer = engine.wrap_optimizer(
        make_optimizer(config, model), model,
        GradientSync(train.accumulate, train.compression, train.adasum, train.shard_optimizer, train.powersgd_rank,
                     train.seed, precision.loss_scale),
    )
    # Compiled after wrapping: Horovod's hooks sit on the parameters, which compiling keeps.
    forward = torch.compile(model) if config.train.compile else model
    return Run(forward, optimizer, task, split, precision, shapes,
               workers=data_workers(config.data.num_workers, split.train, engine.device.type, engine.local_size),
               collate=collate)


def _refuse_complex_weights_on_a_real_wire(model: nn.Module, compression: str, sharded: bool) -> None:
    """bf16 and PowerSGD on the wire, and fp16 with the optimizer sharded, send real numbers: a complex
    gradient would lose its imaginary part without a word."""
    lossy = compression in ("bf16", "powersgd") or (compression == "fp16" and sharded)
    complex_weights = [name for name, p in model.named_parameters() if p.requires_grad and p.is_complex()]
    if lossy and complex_weights:
        given = f"--compression {compression}" + (" with --shard-optimizer" if compression == "fp16" else "")
        raise UserError(f"the model has complex weights ({', '.join(complex_weights[:3])}), whose gradients {given} "
                        "would send without their imaginary parts: leave --compression out"
                        + (", or keep fp16 without --shard-optimizer" if sharded or compression == "fp16" else ""))


def _refuse_raw_samples(split: DataSplit, config: Config) -> None:
    """Samples as a file or a library gives them, before anything makes them what a batch needs."""
    if split.text_target is not None and config.task.name in BUILT_IN_TASKS and config.data.collate is None:
        raise UserError(f"the samples' targets are text ({split.text_target!r} in the first): task "
                        f"{config.task.name} needs numbers: map each class name to its index in your Dataset, and "
                        "give it a `classes` list of the names (hvdtrain sizes the model by it)")
    if split.image_input and config.data.collate is None:
        raise UserError("the samples' inputs are PIL images, which do not stack into a batch: give your Dataset a "
                        "transform that makes each a tensor (torchvision's transforms.ToTensor()), or batch them with "
                        "a function of yours (--set data.collate=package.module:function)")


def _module_to_train(model: nn.Module, config: Config, rank: int) -> nn.Module:
    """The model as built, DataParallel or DDP taken off; rank 0 says what of a script written for another
    trainer hvdtrain does not use."""
    if type(model) in DATA_PARALLEL:
        if rank == 0:
            warn(f"the model comes wrapped in {type(model).__name__}: hvdtrain trains the module inside it (one "
                 "process per device, its gradients averaged by the engine); return the module itself")
        model = model.module
    if any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
        raise UserError("the model's parameters are on the meta device (built under torch.device('meta')), which "
                        "holds no values: build it with real tensors, or give them values in your factory "
                        "(model.to_empty(device='cpu'), then its initialisation or load_state_dict)")
    if rank == 0 and callable(getattr(model, "training_step", None)) and config.task.name in BUILT_IN_TASKS:
        warn(f"the model has a training_step (a LightningModule's), which hvdtrain never calls, nor "
             f"configure_optimizers: it trains forward's output with task {config.task.name}'s loss; give your loss "
             "as --task package.module:function, and your optimizer as --optimizer")
    return model


def shard(run: Run, config: Config, engine: Engine) -> Shard:
    """This rank's batches for the current world size."""
    batch, accumulate = config.data.batch_size, config.train.accumulate
    train_size = len(run.split.train)
    # dist: each rank takes its slice of every global batch; the same count on every rank.
    sampler = train_sampler(run.split.train, config, engine.rank, engine.size, run.workers[0])
    if len(sampler) == 0:
        raise UserError(
            f"the training set has {train_size} samples, fewer than one optimizer step needs "
            f"(batch {batch} x {engine.size} processes x accumulate {accumulate}): "
            "lower --batch-size or --accumulate, or use fewer processes"
        )
    val_sampler = EvalShardSampler(len(run.split.val), batch, engine.rank, engine.size)
    pin = engine.device.type == "cuda"  # pinned host memory lets copies to the GPU overlap compute
    stop = tuple(signal_numbers(config.run.stop_signals))
    val = batches(run.split.val, val_sampler, run.workers[1], pin, run.collate, stop)
    train = batches(run.split.train, sampler, run.workers[0], pin, run.collate, stop)
    return Shard(sampler, train, prepared_batches(val, run.split.val, engine.device),  # images: converted on the device
                 StepCount.of(sampler, accumulate), (train, val))


def train_sampler(dataset: Dataset, config: Config, rank: int, size: int, workers: int) -> TrainingSampler:
    return training_sampler(dataset, config.data.batch_size, rank, size, seed=config.train.seed,
                            multiple=config.train.accumulate, buffer=config.data.shuffle_buffer, workers=workers)


def check_task(run: Run, config: Config, engine: Engine) -> tuple[FirstBatch, tuple[str, bool]]:
    """The task and model on one batch before training (no collectives): labels that the model
    cannot score, a loss that is not a finite scalar, metrics that are not sums and counts. Returns
    what the batch showed, and the best checkpoint's metric (its record key, whether higher is better)."""
    batch = first_batch(run.split.train, config.data.batch_size, run.collate, "training", engine.device,
                        config.train.channels_last)
    first = check_first_batch(run.task, run.model, batch, run.split.held_targets, run.precision)
    return first, best_metric(config.run.best_metric, config.run.best_mode, run.task, first.reported)


def check_same_data(run: Run, engine: Engine) -> None:
    """Every rank must see the same data set, or ranks would wait on each other forever.

    Each rank builds the data itself (a factory may read per-host files); the batch
    counts follow from the sizes (the rest of the config is the same everywhere), and a
    rank with more batches would wait in an allreduce that the others never join. Of the
    same size, a few samples tell whether they are the same ones (`same_samples`).
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
    check_same_samples({"train": train, "val": run.split.val}, engine)  # dist


def make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
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
    # `params` makes a torch.optim class itself a factory: --optimizer torch.optim:Adam
    offered = {"model": model, "params": list(model.parameters()), "lr": cfg.lr}
    plain = ("return the optimizer itself (torch.optim.SGD(params, ...)): hvdtrain distributes it on either engine, "
             "with --compression, --accumulate, --adasum and --shard-optimizer for what such wrappers take")
    try:
        made = call_factory(cfg.name, "optimizer", offered, args=cfg.args, args_key="optim.args",
                            convention=("model", "lr"))
    except UserError as err:  # such a wrapper, from a script written for it, where its library is not started
        if not (library := unstarted_library(err)):
            raise
        raise UserError(f"optimizer factory '{cfg.name}' uses {library}, which this engine has not started "
                        f"({type(err.__cause__).__name__}: {err.__cause__}): {plain}") from err.__cause__
    if _holds_an_optimizer(made):  # (optimizer, scheduler), as Lightning's configure_optimizers returns
        raise UserError(f"optimizer factory '{cfg.name}' returned a {type(made).__name__} holding the optimizer: return "
                        "the optimizer alone; hvdtrain sets the learning rate itself (--lr, --warmup-epochs, --schedule)")
    if not isinstance(made, torch.optim.Optimizer):
        raise UserError(f"optimizer factory '{cfg.name}' returned {type(made).__name__}: return a "
                        "torch.optim.Optimizer over the model's parameters")
    own = {id(param) for param in model.parameters()}
    foreign = [param for group in made.param_groups for param in group["params"] if id(param) not in own]
    if foreign:  # they would train in the model's stead, or nothing at all
        raise UserError(f"optimizer factory '{cfg.name}' made an optimizer over {len(foreign)} tensor(s) that are not "
                        f"the model's parameters (the first of shape {tuple(foreign[0].shape)}): build it over the "
                        "`params` (or `model`) it is given")
    if wrapper := _distributed_wrapper(made):
        raise UserError(f"optimizer factory '{cfg.name}' returned {wrapper}: {plain}")
    if isinstance(made, torch.optim.SparseAdam):  # it refuses dense gradients at its first step, on every rank
        raise UserError(f"optimizer factory '{cfg.name}' made a SparseAdam, which takes sparse gradients only, and "
                        "gradients are allreduced dense: use torch.optim:Adam (or adamw), the same update on them")
    for group in made.param_groups:  # each group follows the schedule at its own ratio to optim.lr
        group.setdefault("lr_ratio", group["lr"] / cfg.lr)
    return made


def _holds_an_optimizer(made: Any) -> bool:
    items = made.values() if isinstance(made, dict) else made if isinstance(made, (list, tuple)) else ()
    return any(isinstance(item, torch.optim.Optimizer) or _holds_an_optimizer(item) for item in items)


def _distributed_wrapper(optimizer: torch.optim.Optimizer) -> str:
    """The name of a distributed optimizer that wraps another ("" for a plain one): Horovod's
    DistributedOptimizer (a subclass made at run time of the optimizer it wraps, whose gradient hooks
    would allreduce every gradient a second time) or torch's ZeroRedundancyOptimizer."""
    if any(cls.__module__.startswith("horovod.") for cls in type(optimizer).__mro__):
        return "Horovod's DistributedOptimizer"
    return "a ZeroRedundancyOptimizer" if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else ""


def state_factor(config: Config) -> int | None:
    """Optimizer state per parameter, in parameters' sizes (SGD's momentum: 1, AdamW's moments: 2);
    None for a user's optimizer (known after its first step)."""
    if config.optim.name == "sgd":
        return 1 if config.optim.momentum else 0
    return 2 if config.optim.name == "adamw" else None


def holdings_line(run: Run, config: Config, engine: Engine) -> str:
    """What this rank holds with a sharded optimizer, for its start line: the engine's own partition."""
    def nbytes(params: list[nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    params = [p for p in unwrapped(run.model).parameters() if p.requires_grad]
    mine = nbytes([p for p in params if p in engine.gradient_shards.owned])
    factor = state_factor(config)
    state = mib(mine * factor) if factor is not None else f"your optimizer's for {mib(mine)} of parameters"
    return (f"rank {engine.rank}/{engine.size} holds parameters {mib(nbytes(params))} (all), gradients "
            f"{mib(mine)} and optimizer state {state} (its share: --shard-optimizer)")



def keep_learning_rate(config: Config, lr_batch: int) -> None:
    """A resumed run keeps the global batch its lr was for (unless optim.lr_batch is set): on another
    number of processes with the same global batch the learning rate stays the same."""
    if lr_batch and config.optim.lr_batch is None:
        config.optim.lr_batch = lr_batch

"""The sections that name what a run builds: its data, model, task and optimizer, each a built-in
name or a `package.module:function` factory, whose own arguments are the section's `args`.

Every field has a docstring; `hvdtrain config` prints them as a commented YAML file.
Fields whose meaning depends on the world size say so with `dist:`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional

from hvdtrain.config.coercion import require
from hvdtrain.factory import colon_hint


@dataclass
class DataConfig:
    name: str = "digits"
    """Data set: `digits` (scikit-learn's 8x8 digits), `random` (synthetic), an `.npz` file of
    `x` and `y`, a directory of `x.npy` and `y.npy` (memory-mapped; or `train/` and `val/` of them),
    a token file `.bin` (memory-mapped; `val.bin` beside `train.bin` is its validation part), a
    Hugging Face `save_to_disk` directory, `.arrow` or `.parquet` file, WebDataset tar shards (a
    directory of `.tar`, `shards/{000..009}.tar` or `shards/*.tar`, read as a stream), a directory of
    class folders of images (`train/<class>/*.jpg` and `val/`, or `<class>/*.jpg`; JPEG, PNG, WebP), or
    `package.module:function` returning a torch Dataset, an IterableDataset with a length, or a (train, val) pair."""
    args: Dict[str, Any] = field(default_factory=dict)
    """A `package.module:function` data set's own arguments, by name (`--set data.args.length=1000`)."""
    batch_size: int = 64
    """Samples per process per step. dist: the global batch is batch_size x world size x train.accumulate."""
    val_fraction: float = 0.2
    """Share of a data set held out for validation (unless the source gives a (train, val) pair)."""
    num_workers: int = -1
    """DataLoader worker processes per rank, training and validation loaders together (validation a
    quarter); -1: none for data held in tensors or on the CPU, else up to 4 per GPU process."""
    samples: int = 4096
    """`random` only: number of samples."""
    features: int = 64
    """`random` only: features per sample."""
    classes: int = 10
    """`random` only: number of classes."""
    context: int = 256
    """Token files (`.bin`) only: tokens per sample, each window read as one sequence."""
    token_dtype: str = "uint16"
    """Token files only: the width of a token id, uint16 (vocabularies up to 65536) or uint32."""
    input_columns: Optional[str] = None
    """Hugging Face data and shards: the input columns (a shard's: extensions), comma-separated
    (None: every column but the target; several make a dict of named inputs)."""
    target_column: Optional[str] = None
    """Hugging Face data and shards: the target column (None: `label` or `labels`; shards: `cls` first)."""
    shuffle_buffer: int = 1000
    """Streams (shards, an IterableDataset): samples per rank held and served in a shuffled order."""
    image_size: Optional[int] = None
    """Image folders: decode each image to this side (shorter side scaled, centre square cut); unset:
    as stored, which then must be one size for all."""
    augment: Dict[str, Any] = field(default_factory=dict)
    """Image folders: augmentation on the device, per training batch (README, Images): `enabled`,
    `size`, `scale`, `ratio`, `flip`, `jitter`, `mean`, `std` (`--set data.augment.flip=false`)."""
    num_classes: Optional[int] = None
    """Classes (or vocabulary size) for the model when the data set does not say (no `classes` attribute, labels not held)."""
    in_turn: bool = True
    """dist: make the data on rank 0 first, then on each other host's first rank, then on every other rank
    at once: what a factory downloads or caches is fetched once, not by every rank over the same files.
    false: every rank at once, for a factory that waits for the other ranks itself (a barrier after its
    download on rank 0), which would otherwise wait for ranks that wait for it."""
    collate: Optional[str] = None
    """How samples become a batch: None (PyTorch's default: stacks tensors, keeps tuples and
    dicts), `pad` (pads variable-length sequences to the longest in the batch: targets
    with task.ignore_index, inputs with 0), or `package.module:function` taking a list
    of samples and returning a batch."""

    def __post_init__(self) -> None:
        require(self.name.strip() != "", "data.name", "must name a data set, e.g. digits")
        _args_need_a_factory(self.args, self.name, "data")
        require(self.batch_size >= 1, "data.batch_size", f"must be at least 1, got {self.batch_size}")
        require(0.0 < self.val_fraction < 1.0, "data.val_fraction", "must be more than 0 and less than 1 (fit "
                f"validates every epoch on the samples held out), got {self.val_fraction}")
        require(self.num_workers >= -1, "data.num_workers", f"must be -1 (auto) or more, got {self.num_workers}")
        require(self.samples >= 2, "data.samples", f"must be at least 2, got {self.samples}")
        require(self.features >= 1, "data.features", f"must be at least 1, got {self.features}")
        require(self.classes >= 2, "data.classes", f"must be at least 2, got {self.classes}")
        require(self.context >= 1, "data.context", f"must be at least 1, got {self.context}")
        require(self.shuffle_buffer >= 1, "data.shuffle_buffer", f"must be at least 1, got {self.shuffle_buffer}")
        require(self.token_dtype in ("uint16", "uint32"), "data.token_dtype",
                f"must be uint16 or uint32, got '{self.token_dtype}'")
        if self.image_size is not None:
            require(self.image_size >= 1, "data.image_size", f"must be at least 1, got {self.image_size}")
        if self.num_classes is not None:
            require(self.num_classes >= 1, "data.num_classes", f"must be at least 1, got {self.num_classes}")
        if self.collate is not None:
            require(self.collate == "pad" or ":" in self.collate, "data.collate",
                    f"must be pad or package.module:function, got '{self.collate}'{colon_hint(self.collate)}")


@dataclass
class ModelConfig:
    name: str = "mlp"
    """Model: `mlp`, `cnn`, `resnet18`, `resnet34`, `resnet50`, `resnet101`, `resnet152` (torchvision's
    layout and parameter names), or `package.module:function` returning an nn.Module (given those of
    `input_shape`, `num_classes` and `num_outputs`, the outputs per sample the task needs, that it
    declares; one taking `**kwargs` is given `num_classes`)."""
    args: Dict[str, Any] = field(default_factory=dict)
    """A `package.module:function` model's own arguments, by name (`--set model.args.depth=50`)."""
    hidden: int = 128
    """`mlp`: width of the hidden layer; `cnn`: channels of the first convolution."""

    def __post_init__(self) -> None:
        require(self.name.strip() != "", "model.name", "must name a model, e.g. mlp")
        _args_need_a_factory(self.args, self.name, "model")
        require(self.hidden >= 1, "model.hidden", f"must be at least 1, got {self.hidden}")


@dataclass
class TaskConfig:
    name: str = "classification"
    """What a batch means: `classification` (cross-entropy; accuracy, top-5 accuracy),
    `regression` (MSE, L1 or Huber; MSE, MAE, R²), `multilabel` (binary cross-entropy per
    class; exact match, micro-F1), `language-model` (next-token cross-entropy; token
    accuracy, perplexity), or `package.module:function`: your own loss function or task
    object (README: Your own task)."""
    args: Dict[str, Any] = field(default_factory=dict)
    """A `package.module:function` task's own arguments, by name (`--set task.args.beta=0.5`)."""
    target_key: str = "labels"
    """Dict batches: the key holding the target (passed to the model too when its forward takes it)."""
    label_smoothing: float = 0.0
    """`classification`: label smoothing of the cross-entropy."""
    ignore_index: int = -100
    """`classification`, `language-model`: a target with this value is not scored."""
    regression_loss: Literal["mse", "l1", "huber"] = "mse"
    """`regression`: the training loss."""
    huber_delta: float = 1.0
    """`regression` with the huber loss: where it turns from quadratic to linear."""
    shift: bool = True
    """`language-model`: position t predicts target t + 1 (targets are the input ids, as in
    Hugging Face); false when the data set gives targets already shifted."""

    def __post_init__(self) -> None:
        require(self.name.strip() != "", "task.name", "must name a task, e.g. classification")
        _args_need_a_factory(self.args, self.name, "task")
        require(self.target_key != "", "task.target_key", "must not be empty")
        require(0.0 <= self.label_smoothing < 1.0, "task.label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        require(self.huber_delta > 0, "task.huber_delta", f"must be positive, got {self.huber_delta}")


BUILT_IN_OPTIMIZERS = frozenset({"sgd", "adamw"})


@dataclass
class OptimConfig:
    name: str = "sgd"
    """`sgd`, `adamw` (no weight decay on parameters of fewer than 2 dimensions: biases, norm scales),
    or `package.module:function` given those of the model, its parameters (`params`) and lr that it declares, so
    a torch.optim class itself is one: `torch.optim:Adam` (each group's lr keeps its ratio to `lr`)."""
    args: Dict[str, Any] = field(default_factory=dict)
    """A `package.module:function` optimizer's own arguments, by name (`--set optim.args.eps=1e-6`)."""
    lr: float = 0.05
    """Learning rate for a global batch of `lr_batch` samples. dist: with scale_lr, multiplied by
    global batch / lr_batch."""
    lr_batch: Optional[int] = None
    """The global batch `lr` is meant for (None: data.batch_size, one process's batch; a resume keeps
    the checkpoint's, so the same global batch on another number of processes keeps the same lr)."""
    momentum: float = 0.9
    """SGD momentum (`sgd` only: another optimizer's own is in optim.args)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW; `sgd` and `adamw` only: another optimizer's own is in optim.args)."""
    scale_lr: bool = True
    """dist: scale lr linearly with the global batch (Goyal et al., 2017)."""
    warmup_epochs: float = 1.0
    """dist: epochs over which lr ramps linearly from `lr` to the scaled lr (0 to switch off)."""
    schedule: Literal["constant", "cosine", "linear", "step", "onecycle"] = "constant"
    """After the warm-up: `constant`; `cosine` or `linear` to 0; `step`: times step_gamma every
    step_every_epochs; `onecycle`: cosine from 1/25 up over 30% (its warm-up), then down to 1/250000."""
    step_every_epochs: float = 30.0
    """`step` schedule: epochs (after the warm-up) between two decays of the lr."""
    step_gamma: float = 0.1
    """`step` schedule: each decay's factor."""
    clip_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value, after the allreduce (None: no clipping)."""

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", f"must be positive, got {self.lr}")
        require(self.name in BUILT_IN_OPTIMIZERS or ":" in self.name, "optim.name",
                f"must be sgd, adamw or package.module:function, got '{self.name}'{colon_hint(self.name)}")
        _args_need_a_factory(self.args, self.name, "optim")
        if self.lr_batch is not None:
            require(self.lr_batch > 0, "optim.lr_batch", f"must be positive, got {self.lr_batch}")
        require(0 <= self.momentum < 1, "optim.momentum", f"must be in [0, 1), got {self.momentum}")
        require(self.weight_decay >= 0, "optim.weight_decay", f"must be 0 or more, got {self.weight_decay}")
        require(self.warmup_epochs >= 0, "optim.warmup_epochs", f"must be 0 or more, got {self.warmup_epochs}")
        require(self.step_every_epochs > 0, "optim.step_every_epochs", f"must be positive, got {self.step_every_epochs}")
        require(0 < self.step_gamma <= 1, "optim.step_gamma", f"must be in (0, 1], got {self.step_gamma}")
        if self.clip_grad_norm is not None:
            require(self.clip_grad_norm > 0, "optim.clip_grad_norm", f"must be positive, got {self.clip_grad_norm}")

    def refuse_keys_that_change_nothing(self) -> None:
        """For fit: a key this optimizer does not read is refused rather than ignored (defaults pass). Not
        on loading a run's saved config, which evaluate and predict take as it was."""
        require(self.name == "sgd" or self.momentum == OptimConfig.momentum, "optim.momentum",
                f"is sgd's, and optim.name is '{self.name}'"
                + (": for AdamW's betas use --optimizer torch.optim:AdamW --set 'optim.args.betas=[0.9, 0.95]'"
                   if self.name == "adamw" else ": give your optimizer's own in optim.args (--set optim.args.momentum=...)"))
        require(self.name in BUILT_IN_OPTIMIZERS or self.weight_decay == OptimConfig.weight_decay, "optim.weight_decay",
                f"is for sgd and adamw, and optim.name is '{self.name}': give your optimizer's own in optim.args "
                "(--set optim.args.weight_decay=...)")


def _args_need_a_factory(args: Dict[str, Any], name: str, section: str) -> None:
    require(not args or ":" in name, f"{section}.args",
            f"gives a package.module:function its own arguments; '{name}' is built in (its keys are {section}.*)")

"""The typed run configuration: one dataclass per section, a docstring per field, validation in
`__post_init__`.

Every field has a docstring; `hvdtrain config` prints them as a commented YAML file.
Fields whose meaning depends on the world size say so with `dist:`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hvdtrain.config.coercion import build_section, merge_overrides, reject_unknown
from hvdtrain.errors import UserError


@dataclass
class DataConfig:
    name: str = "digits"
    """Data set: `digits` (scikit-learn's 8x8 digits), `random` (synthetic), an `.npz` file of
    `x` and `y`, a directory of `x.npy` and `y.npy` (memory-mapped; or `train/` and `val/` of them),
    a token file `.bin` (memory-mapped; `val.bin` beside `train.bin` is its validation part), a
    Hugging Face `save_to_disk` directory, `.arrow` or `.parquet` file, WebDataset tar shards (a
    directory of `.tar`, `shards/{000..009}.tar` or `shards/*.tar`, read as a stream), or
    `package.module:function` returning a torch Dataset, an IterableDataset with a length, or a (train, val) pair."""
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
    num_classes: Optional[int] = None
    """Classes (or vocabulary size) for the model when the data set does not say (no `classes` attribute, labels not held)."""
    collate: Optional[str] = None
    """How samples become a batch: None (PyTorch's default: stacks tensors, keeps tuples and
    dicts), `pad` (pads variable-length sequences to the longest in the batch: targets
    with task.ignore_index, inputs with 0), or `package.module:function` taking a list
    of samples and returning a batch."""

    def __post_init__(self) -> None:
        _require(self.name.strip() != "", "data.name", "must name a data set, e.g. digits")
        _require(self.batch_size >= 1, "data.batch_size", f"must be at least 1, got {self.batch_size}")
        _require(0.0 < self.val_fraction < 1.0, "data.val_fraction", f"must be between 0 and 1, got {self.val_fraction}")
        _require(self.num_workers >= -1, "data.num_workers", f"must be -1 (auto) or more, got {self.num_workers}")
        _require(self.samples >= 2, "data.samples", f"must be at least 2, got {self.samples}")
        _require(self.features >= 1, "data.features", f"must be at least 1, got {self.features}")
        _require(self.classes >= 2, "data.classes", f"must be at least 2, got {self.classes}")
        _require(self.context >= 1, "data.context", f"must be at least 1, got {self.context}")
        _require(self.shuffle_buffer >= 1, "data.shuffle_buffer", f"must be at least 1, got {self.shuffle_buffer}")
        _require(self.token_dtype in ("uint16", "uint32"), "data.token_dtype",
                 f"must be uint16 or uint32, got '{self.token_dtype}'")
        if self.num_classes is not None:
            _require(self.num_classes >= 1, "data.num_classes", f"must be at least 1, got {self.num_classes}")
        if self.collate is not None:
            _require(self.collate == "pad" or ":" in self.collate, "data.collate",
                     f"must be pad or package.module:function, got '{self.collate}'")


@dataclass
class ModelConfig:
    name: str = "mlp"
    """Model: `mlp`, `cnn`, or `package.module:function` returning an nn.Module (it may take
    `input_shape`, `num_classes` and `num_outputs`, the outputs per sample the task needs)."""
    hidden: int = 128
    """`mlp`: width of the hidden layer; `cnn`: channels of the first convolution."""

    def __post_init__(self) -> None:
        _require(self.name.strip() != "", "model.name", "must name a model, e.g. mlp")
        _require(self.hidden >= 1, "model.hidden", f"must be at least 1, got {self.hidden}")


@dataclass
class TaskConfig:
    name: str = "classification"
    """What a batch means: `classification` (cross-entropy; accuracy, top-5 accuracy),
    `regression` (MSE, L1 or Huber; MSE, MAE, R²), `multilabel` (binary cross-entropy per
    class; exact match, micro-F1), `language-model` (next-token cross-entropy; token
    accuracy, perplexity), or `package.module:function`: your own loss function or task
    object (README: Your own task)."""
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
        _require(self.name.strip() != "", "task.name", "must name a task, e.g. classification")
        _require(self.target_key != "", "task.target_key", "must not be empty")
        _require(0.0 <= self.label_smoothing < 1.0, "task.label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        _require(self.huber_delta > 0, "task.huber_delta", f"must be positive, got {self.huber_delta}")


@dataclass
class OptimConfig:
    name: str = "sgd"
    """`sgd`, `adamw` (no weight decay on parameters of fewer than 2 dimensions: biases, norm scales),
    or `package.module:function` given the model and lr (each group's lr keeps its ratio to `lr`)."""
    lr: float = 0.05
    """Learning rate for a global batch of `lr_batch` samples. dist: with scale_lr, multiplied by
    global batch / lr_batch."""
    lr_batch: Optional[int] = None
    """The global batch `lr` is meant for (None: data.batch_size, one process's batch; a resume keeps
    the checkpoint's, so the same global batch on another number of processes keeps the same lr)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW)."""
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
        _require(self.lr > 0, "optim.lr", f"must be positive, got {self.lr}")
        _require(self.name in ("sgd", "adamw") or ":" in self.name, "optim.name",
                 f"must be sgd, adamw or package.module:function, got '{self.name}'")
        if self.lr_batch is not None:
            _require(self.lr_batch > 0, "optim.lr_batch", f"must be positive, got {self.lr_batch}")
        _require(0 <= self.momentum < 1, "optim.momentum", f"must be in [0, 1), got {self.momentum}")
        _require(self.weight_decay >= 0, "optim.weight_decay", f"must be 0 or more, got {self.weight_decay}")
        _require(self.warmup_epochs >= 0, "optim.warmup_epochs", f"must be 0 or more, got {self.warmup_epochs}")
        _require(self.step_every_epochs > 0, "optim.step_every_epochs", f"must be positive, got {self.step_every_epochs}")
        _require(0 < self.step_gamma <= 1, "optim.step_gamma", f"must be in (0, 1], got {self.step_gamma}")
        if self.clip_grad_norm is not None:
            _require(self.clip_grad_norm > 0, "optim.clip_grad_norm", f"must be positive, got {self.clip_grad_norm}")


@dataclass
class TrainConfig:
    epochs: int = 20
    """Passes over the training data."""
    seed: int = 0
    """Seed for initial weights, data order and augmentation; the same seed gives the same run on CPU."""
    accumulate: int = 1
    """dist: backward passes per optimizer step (Horovod's backward_passes_per_step)."""
    compression: Literal["none", "fp16"] = "none"
    """dist: compress gradients to fp16 for the allreduce."""
    adasum: bool = False
    """dist: combine gradients with Adasum instead of averaging (needs the MPI controller)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """dist: `auto` uses cuda:<local rank> (among the visible GPUs) when there are GPUs, else the CPU."""
    precision: Literal["32", "bf16", "fp16"] = "32"
    """`bf16`: autocast to bfloat16; `fp16`: autocast to float16 with a gradient scaler; `32`: float32."""
    channels_last: bool = False
    """Convolutional models: keep weights and 4-d inputs in channels-last memory format."""
    compile: bool = False
    """Compile the model with torch.compile (slower start, often faster steps)."""
    threads: int = 0
    """dist: torch threads per process; 0 divides this host's cores among its local processes."""
    nonfinite: Literal["error", "skip"] = "error"
    """A NaN or Inf loss on any rank: `error` stops every rank at that step (checkpoints kept);
    `skip` drops that step's update on every rank and goes on. With fp16 the gradient scaler skips."""
    dist_bn: Literal["reduce", "broadcast", "off"] = "reduce"
    """dist: BatchNorm running statistics follow each rank's own batches; before each validation and
    checkpoint `reduce` averages them over ranks, `broadcast` takes rank 0's, `off` leaves each rank
    its own (validation then uses each rank's, and `evaluate` of a checkpoint differs from fit's)."""
    stall_timeout: int = 300
    """dist: seconds a collective may wait for missing ranks before the job stops, naming them
    (Horovod's stall inspector under MPI, hvdtrain's watchdog under Gloo; 0 switches it off)."""
    keep_freed_memory: bool = True
    """Keep large freed host blocks for reuse instead of returning them to the OS each step
    (glibc's mmap and trim thresholds; +15% samples/s on the CPU benchmark)."""
    engine: Literal["auto", "horovod", "torch", "local"] = "auto"
    """`auto`: torch.distributed under torchrun, Horovod when started by horovodrun or mpirun,
    else one local process; `torch` also under mpirun or srun (no Horovod or MPI library needed)."""
    elastic: bool = False
    """dist: elastic training under `horovodrun --gloo --min-np M --host-discovery-script S`:
    processes may be lost or added; the others go on from the last commit."""
    commit_every: int = 20
    """dist: elastic training keeps model, optimizer and position in memory every this many
    optimizer steps (and after each epoch); a lost process costs at most that much work."""
    callbacks: str = ""
    """Your callbacks, comma-separated `package.module:Class` or `:object` (README, Callbacks)."""
    early_stopping_patience: Optional[int] = None
    """Stop every rank once run.best_metric has not improved for this many epochs (unset: off)."""
    early_stopping_min_delta: float = 0.0
    """Early stopping: an improvement is a change of more than this in run.best_metric."""
    sync_batchnorm: bool = False
    """dist: BatchNorm normalizes each training batch over the global batch, not this rank's share."""

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "train.epochs", f"must be at least 1, got {self.epochs}")
        _require(self.accumulate >= 1, "train.accumulate", f"must be at least 1, got {self.accumulate}")
        _require(self.threads >= 0, "train.threads", f"must be 0 (auto) or more, got {self.threads}")
        _require(self.commit_every >= 1, "train.commit_every", f"must be at least 1, got {self.commit_every}")
        _require(self.stall_timeout >= 0, "train.stall_timeout", f"must be 0 (off) or more, got {self.stall_timeout}")
        _require(self.early_stopping_patience is None or self.early_stopping_patience >= 1, "train.early_stopping_patience",
                 f"must be at least 1, got {self.early_stopping_patience}")
        _require(self.early_stopping_min_delta >= 0, "train.early_stopping_min_delta",
                 f"must be 0 or more, got {self.early_stopping_min_delta}")
        _require(not (self.sync_batchnorm and self.compile), "train.sync_batchnorm", "does not combine with train.compile yet")


@dataclass
class RunConfig:
    dir: Optional[str] = None
    """Run directory (default: runs/fit-<date>-<time>). Holds config.yaml, metrics.jsonl, summary.json, checkpoints/."""
    resume: Literal[False, True, "auto"] = False
    """Continue from the newest checkpoint in the run directory; `auto`: continue when it has a
    checkpoint, else start there afresh (for requeued jobs and restart policies)."""
    overwrite: bool = False
    """Start afresh in an existing run directory, deleting what it holds."""
    checkpoint_every: int = 1
    """Write a checkpoint every this many epochs (the last epoch always gets one)."""
    checkpoint_every_steps: Optional[int] = None
    """Also write a checkpoint every this many optimizer steps inside an epoch (unset: at epoch ends
    only). `--resume` goes on from it at the exact sample, on any number of processes."""
    checkpoint_every_minutes: Optional[float] = None
    """Also write a checkpoint inside an epoch once this many minutes have passed since the last one
    (rank 0's clock; unset: off). dist: every rank learns it in the per-step stop check."""
    stop_signals: str = "SIGTERM,SIGINT,SIGUSR1"
    """Signals (comma-separated; empty: none) that make every rank stop at the same optimizer step,
    write a checkpoint there and exit with status 75 (continue with --resume). A second one ends the
    process at once. dist: a signal to any one rank stops them all (see stop_check_seconds)."""
    stop_check_seconds: float = 0.5
    """dist: about how often, in seconds of training, the ranks check together for a stop signal (one
    tiny allreduce, at steps rank 0 picks from the step time); 0: after every optimizer step."""
    keep_last: int = 3
    """Keep this many newest checkpoints (and the best one as well)."""
    checkpoint_timeout: float = 1800
    """Seconds a checkpoint write on rank 0 may take before every rank stops with that error (a file
    system that hangs). dist: the others wait for it in short checks, never long enough for the stall
    timeout to take them for stalled."""
    best_metric: str = "auto"
    """The validation metric that picks best.pt, e.g. val_loss or val_f1; `auto`: the task's
    own (val_acc, val_r2, val_f1, val_perplexity; val_loss for a task of your own)."""
    best_mode: Literal["auto", "max", "min"] = "auto"
    """Whether a higher (`max`) or lower (`min`) best_metric is better; `auto`: as the task says."""
    progress: Literal["auto", "bar", "off"] = "auto"
    """Rank 0's progress bar: `auto` shows it when the terminal is interactive."""
    tensorboard: bool = True
    """Rank 0 writes TensorBoard event files into the run directory (tensorboard --logdir runs)."""
    mlflow: bool = False
    """Rank 0 also logs to MLflow ($MLFLOW_TRACKING_URI, else ./mlruns): params, metrics, artifacts."""
    log_every: int = 0
    """Also log the training loss (mean over ranks and steps), learning rate and samples/s every
    this many optimizer steps; 0: once per epoch only. dist: one small allreduce each time."""
    horovod_timeline: bool = False
    """Record Horovod's timeline of the run (every allreduce, per tensor and phase) as a Chrome
    trace in horovod-timeline.json in the run directory; open it in Perfetto (ui.perfetto.dev)."""

    def __post_init__(self) -> None:
        _require(self.log_every >= 0, "run.log_every", f"must be 0 (per epoch) or more, got {self.log_every}")
        _require(self.checkpoint_every >= 1, "run.checkpoint_every", f"must be at least 1, got {self.checkpoint_every}")
        _require(self.checkpoint_every_steps is None or self.checkpoint_every_steps >= 1, "run.checkpoint_every_steps",
                 f"must be at least 1 (leave it unset for checkpoints at epoch ends only), got {self.checkpoint_every_steps}")
        _require(self.checkpoint_every_minutes is None or self.checkpoint_every_minutes > 0,
                 "run.checkpoint_every_minutes",
                 f"must be more than 0 (leave it unset for no timed checkpoints), got {self.checkpoint_every_minutes}")
        signal_numbers(self.stop_signals)  # names each unknown one
        _require(self.stop_check_seconds >= 0, "run.stop_check_seconds",
                 f"must be 0 (every step) or more, got {self.stop_check_seconds}")
        _require(self.keep_last >= 1, "run.keep_last", f"must be at least 1, got {self.keep_last}")
        _require(self.checkpoint_timeout > 0, "run.checkpoint_timeout", f"must be more than 0, got {self.checkpoint_timeout}")
        _require(not (self.resume and self.overwrite), "run.resume", "and run.overwrite exclude each other: pick one")
        _require(self.best_metric.strip() != "", "run.best_metric", "must name a metric, e.g. val_loss, or be auto")


@dataclass
class Config:
    """Everything one `hvdtrain fit` needs."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.train.adasum:
            # Horovod's Adasum optimizer steps each rank's optimizer inside backward and combines
            # the updates in step(): there is no moment at which gradients could be unscaled,
            # clipped or a step taken back.
            why = "Adasum steps each rank's optimizer inside backward, before"
            _require(self.train.precision != "fp16", "train.adasum",
                     f"does not work with precision fp16: {why} the gradient scaler could unscale; use bf16 or 32")
            _require(self.optim.clip_grad_norm is None, "train.adasum",
                     f"does not work with optim.clip_grad_norm: {why} gradients could be clipped")
            _require(self.train.nonfinite == "error", "train.adasum",
                     "does not work with nonfinite skip: an Adasum step cannot be taken back")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> "Config":
        """Builds a validated config from nested mappings plus dotted-key overrides."""
        merged = merge_overrides(raw, overrides or {})
        sections = {}
        section_types = section_types_of_config()
        reject_unknown(merged, section_types, "")
        for name, section_type in section_types.items():
            values = merged.get(name) or {}
            if not isinstance(values, dict):
                raise UserError(f"config section '{name}' must be a mapping of keys to values, got {values!r}")
            sections[name] = build_section(section_type, values, name)
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def signal_numbers(names: str) -> list[int]:
    """The signals named in run.stop_signals (SIGTERM or TERM, any case), in order."""
    import signal

    numbers = []
    for name in filter(None, (part.strip().upper() for part in names.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        number = getattr(signal, full, None)
        if not isinstance(number, signal.Signals) or full in ("SIGKILL", "SIGSTOP") or full.startswith("SIG_"):
            raise UserError(f"config key 'run.stop_signals': '{name}' is not a signal that can be caught: use names "
                            "such as SIGTERM, SIGINT, SIGUSR1, SIGUSR2, comma-separated (empty: none)")
        numbers.append(int(number))
    return numbers


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise UserError(f"config key '{key}' {message}")


def section_types_of_config() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}

"""The typed run configuration: one dataclass per section, a docstring per field, validation in
`__post_init__`. Here the training and run sections and `Config`, which holds them beside the
sections of what a run builds (`components`: data, model, task, optimizer).

Every field has a docstring; `hvdtrain config` prints them as a commented YAML file.
Fields whose meaning depends on the world size say so with `dist:`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hvdtrain.config.coercion import build_section, merge_overrides, reject_unknown, require
from hvdtrain.config.components import DataConfig, ModelConfig, OptimConfig, TaskConfig
from hvdtrain.errors import UserError


@dataclass
class TrainConfig:
    epochs: int = 20
    """Passes over the training data."""
    seed: int = 0
    """Seed for initial weights, data order and augmentation; the same seed gives the same run on CPU."""
    accumulate: int = 1
    """dist: backward passes per optimizer step (Horovod's backward_passes_per_step)."""
    compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """dist: gradients on the wire in half precision: `fp16` (divided by the world size before the sum, so
    that it cannot overflow) or `bf16` (fp32's range; summed in fp32 where each segment is reduced); or
    `powersgd`: each gradient matrix as two low-rank factors, with error feedback (README, Across a slow network)."""
    powersgd_rank: int = 4
    """dist: with compression powersgd, the rank of each matrix's factors: higher sends more and loses less
    (at 2, 3 epochs of digits at np=2 ended 2 points of val_acc below fp32; at 4, 0.6)."""
    adasum: bool = False
    """dist: combine gradients with Adasum instead of averaging (needs the MPI controller)."""
    shard_optimizer: bool = False
    """dist: each rank keeps the optimizer state (and, after each step's reduce-scatter, the gradients)
    of a 1/N share of the parameters; updated parameters are all-gathered (README, Sharded optimizer state)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """dist: `auto` uses cuda:<local rank> (among the visible GPUs) when there are GPUs, else the CPU."""
    precision: Literal["32", "bf16", "fp16"] = "32"
    """`bf16`: autocast to bfloat16; `fp16`: autocast to float16 with a gradient scaler; `32`: float32."""
    channels_last: bool = False
    """Convolutional models: keep weights and 4-d inputs in channels-last memory format."""
    compile: bool = False
    """Compile the model with torch.compile (slower start, often faster steps)."""
    threads: int = 0
    """dist: torch threads per process; 0: OMP_NUM_THREADS where the user set it (not torchrun's own 1),
    else this host's cores divided among its local processes."""
    nonfinite: Literal["error", "skip"] = "error"
    """A NaN or Inf loss on any rank: `error` stops every rank at that step (checkpoints kept);
    `skip` drops that step's update on every rank and goes on. With fp16 the gradient scaler skips."""
    dist_bn: Literal["reduce", "broadcast", "off"] = "reduce"
    """dist: BatchNorm running statistics follow each rank's own batches; before each validation and
    checkpoint `reduce` averages them over ranks, `broadcast` takes rank 0's, `off` leaves each rank
    its own (validation then uses each rank's, and `evaluate` of a checkpoint differs from fit's)."""
    stall_timeout: int = 300
    """dist: seconds a collective may wait for missing ranks before the job stops, saying where every rank
    was (each one's Python stack, kept in the run directory's where/); 60 at least in set-up, before the
    first step; 0 switches it off."""
    straggler_factor: float = 1.5
    """dist: name a rank in the epoch's line when its time outside collectives (data + compute) is over this
    many times the other ranks' median, with where its time went (README, When a job hangs or is slow); 0: off."""
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
        require(self.epochs >= 1, "train.epochs", f"must be at least 1, got {self.epochs}")
        require(self.accumulate >= 1, "train.accumulate", f"must be at least 1, got {self.accumulate}")
        require(self.threads >= 0, "train.threads", f"must be 0 (auto) or more, got {self.threads}")
        require(self.commit_every >= 1, "train.commit_every", f"must be at least 1, got {self.commit_every}")
        require(self.straggler_factor == 0 or self.straggler_factor > 1, "train.straggler_factor",
                f"must be 0 (off) or more than 1, got {self.straggler_factor}")
        require(self.stall_timeout >= 0, "train.stall_timeout", f"must be 0 (off) or more, got {self.stall_timeout}")
        require(self.early_stopping_patience is None or self.early_stopping_patience >= 1, "train.early_stopping_patience",
                f"must be at least 1, got {self.early_stopping_patience}")
        require(self.early_stopping_min_delta >= 0, "train.early_stopping_min_delta",
                f"must be 0 or more, got {self.early_stopping_min_delta}")
        require(not (self.sync_batchnorm and self.compile), "train.sync_batchnorm", "does not combine with train.compile yet")


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
    stop_signals: str = "SIGTERM,SIGINT,SIGUSR1,SIGHUP"
    """Signals (comma-separated; empty: none) that make every rank stop at the same optimizer step,
    write a checkpoint there and exit with status 75 (continue with --resume). A second one ends the
    process at once. SIGHUP (the terminal closed) stays ignored where the job was started so (nohup).
    dist: a signal to any one rank stops them all (see stop_check_seconds)."""
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
        if self.dir is not None:  # `--run-dir=~/runs/a` reaches here unexpanded: not a folder named `~`
            self.dir = os.path.expanduser(self.dir)
        require(self.log_every >= 0, "run.log_every", f"must be 0 (per epoch) or more, got {self.log_every}")
        require(self.checkpoint_every >= 1, "run.checkpoint_every", f"must be at least 1, got {self.checkpoint_every}")
        require(self.checkpoint_every_steps is None or self.checkpoint_every_steps >= 1, "run.checkpoint_every_steps",
                f"must be at least 1 (leave it unset for checkpoints at epoch ends only), got {self.checkpoint_every_steps}")
        require(self.checkpoint_every_minutes is None or self.checkpoint_every_minutes > 0,
                "run.checkpoint_every_minutes",
                f"must be more than 0 (leave it unset for no timed checkpoints), got {self.checkpoint_every_minutes}")
        signal_numbers(self.stop_signals)  # names each unknown one
        require(self.stop_check_seconds >= 0, "run.stop_check_seconds",
                f"must be 0 (every step) or more, got {self.stop_check_seconds}")
        require(self.keep_last >= 1, "run.keep_last", f"must be at least 1, got {self.keep_last}")
        require(self.checkpoint_timeout > 0, "run.checkpoint_timeout", f"must be more than 0, got {self.checkpoint_timeout}")
        require(not (self.resume and self.overwrite), "run.resume", "and run.overwrite exclude each other: pick one")
        require(self.best_metric.strip() != "", "run.best_metric", "must name a metric, e.g. val_loss, or be auto")


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
        if self.train.shard_optimizer:
            require(not self.train.adasum, "train.shard_optimizer",
                    "does not work with train.adasum: Adasum combines whole parameter updates, not a share of "
                    "the gradients; drop one of --shard-optimizer and --adasum")
            require(not self.train.elastic, "train.shard_optimizer",
                    "does not work with train.elastic yet: a change of processes would need the shares dealt out "
                    "again; drop --elastic, or --shard-optimizer")
        compression = self.train.compression
        if compression in ("bf16", "powersgd"):
            require(not self.train.adasum, "train.compression",
                    f"is {compression}, which does not work with train.adasum: Adasum is Horovod's own combination of "
                    "whole tensors, in fp32 or fp16; use --compression fp16, or drop --adasum")
            require(not self.train.elastic, "train.compression",
                    f"is {compression}, which does not work with train.elastic yet: use --compression fp16, or drop "
                    "--elastic")
        if compression == "powersgd":
            require(not self.train.shard_optimizer, "train.compression",
                    "is powersgd, which does not work with train.shard_optimizer: PowerSGD sends whole gradients' "
                    "factors, not a share of each; use --compression bf16 with --shard-optimizer")
        require(self.train.powersgd_rank >= 1, "train.powersgd_rank", f"must be 1 or more, got {self.train.powersgd_rank}")
        if self.train.adasum:
            # Horovod's Adasum optimizer steps each rank's optimizer inside backward and combines
            # the updates in step(): there is no moment at which gradients could be unscaled,
            # clipped or a step taken back.
            why = "Adasum steps each rank's optimizer inside backward, before"
            require(self.train.precision != "fp16", "train.adasum",
                    f"does not work with precision fp16: {why} the gradient scaler could unscale; use bf16 or 32")
            require(self.optim.clip_grad_norm is None, "train.adasum",
                    f"does not work with optim.clip_grad_norm: {why} gradients could be clipped")
            require(self.train.nonfinite == "error", "train.adasum",
                    "does not work with nonfinite skip: an Adasum step cannot be taken back")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> "Config":
        """Builds a validated config from nested mappings plus dotted-key overrides."""
        homes = key_homes()
        merged = merge_overrides(raw, overrides or {}, homes)
        sections = {}
        section_types = section_types_of_config()
        reject_unknown(merged, section_types, "", homes)
        for name, section_type in section_types.items():
            values = merged.get(name) or {}
            if not isinstance(values, dict):
                raise UserError(f"config section '{name}' must be a mapping of keys to values, got {values!r}")
            sections[name] = build_section(section_type, values, name, homes)
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def warnings(self) -> list[str]:
        """What this config may not mean: said at the start of fit, not refused (a run resumed into
        more epochs may mean a warm-up as long as the epochs asked for now)."""
        warmup, epochs = self.optim.warmup_epochs, self.train.epochs
        if warmup <= epochs:  # the peak is reached by the last step at the latest
            return []
        if self.optim.schedule == "onecycle":
            return [f"optim.warmup_epochs ({warmup:g}) is longer than train.epochs ({epochs}), and the onecycle "
                    "schedule does not use it: its own rise over the first 30% of the run is its warm-up"]
        return [f"optim.warmup_epochs ({warmup:g}) is longer than train.epochs ({epochs}): the learning rate never "
                "reaches its peak in this run; lower --warmup-epochs, unless a resume will train more epochs"]


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


def section_types_of_config() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def key_homes() -> dict[str, list[str]]:
    """Each key's full names (`batch_size`: `data.batch_size`), to point a key in the wrong section at its own."""
    homes: dict[str, list[str]] = {}
    for section, section_type in section_types_of_config().items():
        for key in typing.get_type_hints(section_type):
            homes.setdefault(key, []).append(f"{section}.{key}")
    return homes

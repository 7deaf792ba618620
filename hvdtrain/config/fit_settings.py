"""fit's settings, each declared once: its name (the flag `--batch-size`, `hvdtrain.fit(batch_size=...)`),
the config key it sets and the flag's help. The key's field in `schema` gives its type, choices and
default; the command builds its flags from this table, `hvdtrain.fit` takes the same names, and
`settings_config` turns either into a Config.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.config.coercion import OTHER_TOOLS_NAMES, homes_of
from hvdtrain.config.loading import load_config
from hvdtrain.config.schema import Config, key_homes, section_types_of_config
from hvdtrain.errors import UserError


@dataclass(frozen=True)
class FitSetting:
    name: str
    """The flag without its dashes, `_` for `-` (batch_size: --batch-size), and hvdtrain.fit's keyword."""
    key: str
    """The config key it sets (section.field)."""
    help: str | None = None
    """The flag's help."""
    metavar: str | None = None
    """What the flag's value looks like in the help, where its type does not say."""
    repeatable: bool = False
    """Given several times on the command line (a list from Python): the config value joins them with commas."""
    alone: str | None = None
    """The value of the flag given without one (`--resume`: always), and then the flag's choices are
    `choices`, not the field's values."""
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def field_type(self) -> tuple[Any, Any]:
        """The type and the default of the config field it sets."""
        section, _, name = self.key.partition(".")
        section_type = section_types_of_config()[section]
        default = next(f for f in dataclasses.fields(section_type) if f.name == name).default
        return typing.get_type_hints(section_type)[name], default


# In the order `hvdtrain fit --help` lists them.
FIT = (
    FitSetting("data", "data.name", "digits, random, FILE.npz, a directory of .npy, FILE.bin (tokens), Hugging Face "
                                    "data, tar shards (DIR, 'a-{000..009}.tar'), class folders of images (DIR) or "
                                    "package.module:function."),
    FitSetting("model", "model.name", "mlp, cnn, resnet18/34/50/101/152 or package.module:function."),
    FitSetting("task", "task.name",
               "classification, regression, multilabel, language-model or package.module:function."),
    FitSetting("epochs", "train.epochs"),
    FitSetting("batch_size", "data.batch_size", "Per process. dist: global batch = this x world size."),
    FitSetting("lr", "optim.lr", "For one process's batch (optim.lr_batch); scaled by the global batch unless "
                                 "--no-scale-lr."),
    FitSetting("optimizer", "optim.name", "sgd, adamw, or your own factory (given the model, its params and lr, "
                                          "returning an optimizer): a torch.optim class is one, torch.optim:Adam.",
               metavar="sgd|adamw|MODULE:FUNCTION"),
    FitSetting("scale_lr", "optim.scale_lr", "Scale lr by the global batch (default on)."),
    FitSetting("warmup_epochs", "optim.warmup_epochs", "Linear lr warmup length."),
    FitSetting("schedule", "optim.schedule", "Learning-rate schedule after the warm-up (default constant)."),
    FitSetting("clip_grad_norm", "optim.clip_grad_norm", "Clip the allreduced gradient norm."),
    FitSetting("accumulate", "train.accumulate", "Backward passes per optimizer step."),
    FitSetting("compression", "train.compression",
               "Gradients on the wire in fp16 or bf16 (half the bytes), or as PowerSGD's low-rank factors."),
    FitSetting("powersgd_rank", "train.powersgd_rank", "PowerSGD: the rank of each matrix's factors."),
    FitSetting("adasum", "train.adasum", "Adasum instead of averaging (MPI controller)."),
    FitSetting("shard_optimizer", "train.shard_optimizer",
               "Each rank keeps the optimizer state of 1/N of the parameters (reduce-scatter, all-gather)."),
    FitSetting("seed", "train.seed"),
    FitSetting("device", "train.device"),
    FitSetting("threads", "train.threads", "Torch threads per process (0: OMP_NUM_THREADS where you set it, else cores / local processes)."),
    FitSetting("precision", "train.precision", "fp16 adds a gradient scaler."),
    FitSetting("channels_last", "train.channels_last", "Channels-last memory format for conv models."),
    FitSetting("compile", "train.compile", "torch.compile the model."),
    FitSetting("num_workers", "data.num_workers", "DataLoader workers per process (-1: choose)."),
    FitSetting("nonfinite", "train.nonfinite", "On a NaN/Inf loss: stop, or skip the step."),
    FitSetting("elastic", "train.elastic",
               "Elastic training (horovodrun --gloo --min-np M --host-discovery-script S)."),
    FitSetting("run_dir", "run.dir", "Run directory (default runs/fit-<date>-<time>)."),
    FitSetting("resume", "run.resume", "Continue from the newest checkpoint in --run-dir; `--resume auto`: continue "
                                       "if it has one, else start there afresh.",
               alone="always", choices=("always", "auto")),
    FitSetting("overwrite", "run.overwrite", "Start afresh in an existing --run-dir."),
    FitSetting("checkpoint_every_steps", "run.checkpoint_every_steps",
               "Also checkpoint every N optimizer steps inside an epoch."),
    FitSetting("checkpoint_every_minutes", "run.checkpoint_every_minutes",
               "Also checkpoint inside an epoch every M minutes."),
    FitSetting("stop_signals", "run.stop_signals",
               "Signals that stop every rank at one step with a checkpoint (exit 75); '' for none.",
               metavar="SIGTERM,..."),
    FitSetting("progress", "run.progress", "Rank 0's progress bar."),
    FitSetting("log_every", "run.log_every", "Also log to TensorBoard every N optimizer steps (0: per epoch)."),
    FitSetting("tensorboard", "run.tensorboard", "TensorBoard event files in the run directory (default on)."),
    FitSetting("mlflow", "run.mlflow", "Also log to MLflow ($MLFLOW_TRACKING_URI, else ./mlruns; pip install "
                                       "'hvdtrain[mlflow]')."),
    FitSetting("horovod_timeline", "run.horovod_timeline",
               "Record Horovod's timeline into RUN_DIR/horovod-timeline.json (open it in Perfetto)."),
    FitSetting("callback", "train.callbacks", "Your callback (on_fit_start, on_step_end, on_epoch_end, on_checkpoint, "
                                              "on_fit_end); repeatable.", metavar="MODULE:CLASS", repeatable=True),
    FitSetting("sync_batchnorm", "train.sync_batchnorm",
               "BatchNorm over the global batch (every rank's samples), not each rank's share."),
    FitSetting("early_stopping_patience", "train.early_stopping_patience",
               "Stop every rank once the best metric has not improved for N epochs."),
)

# fit's settings by name (as its flags: --batch-size is batch_size, and as hvdtrain.fit's keyword
# arguments), and the config key each sets. Settings left out keep the YAML (or default) value.
FIT_SETTINGS = {setting.name: setting.key for setting in FIT}
_BY_NAME = {setting.name: setting for setting in FIT}


def _setting_hint(name: str) -> str:
    """The setting meant (other tools' name for it, or a misspelling), or the config key to override."""
    ours = OTHER_TOOLS_NAMES.get(name, name)
    homes = homes_of(name, key_homes())
    by_key = {key: setting for setting, key in FIT_SETTINGS.items()}
    close = ([ours] if ours in FIT_SETTINGS else [by_key[homes[0]]] if len(homes) == 1 and homes[0] in by_key
             else difflib.get_close_matches(name, list(FIT_SETTINGS), n=1, cutoff=0.85))
    if close:
        return f"did you mean {close[0]}=...?"
    return f"did you mean overrides={{'{homes[0]}': ...}}? (it has no flag)" if len(homes) == 1 else ""


CHECKPOINTS = "checkpoints"  # a run's folder of them (io.checkpoint.CHECKPOINTS, whose import pulls in torch)


def not_a_choice(setting: FitSetting, value: str, flag: bool) -> str:
    """The line for a setting of a few words (`--resume`) given another: a path there is another tool's
    habit (`--resume runs/a`, `--resume last.ckpt`), so it names the run directory meant."""
    if flag:
        name, alone, taken = setting.flag, setting.flag, ["no value", *setting.choices]
    else:
        name, alone, taken = setting.name, f"{setting.name}=True", ["True", "False", *map(repr, setting.choices)]
    taken = ", ".join(taken[:-1]) + " or " + taken[-1]
    path = Path(os.path.expanduser(value))
    if setting.key != "run.resume" or not value.strip() or not path.exists():
        return f"{name} takes {taken}, got {value!r}"
    run = path.parent if path.is_dir() and path.name == CHECKPOINTS else path if path.is_dir() else \
        path.parent.parent if path.parent.name == CHECKPOINTS else path.parent
    run_dir = f"--run-dir {shlex.quote(str(run))} " if flag else f"run_dir={str(run)!r}, "
    return (f"{name} takes {taken}, not a path: it continues from the newest intact checkpoint of the run "
            f"directory; for this one: {run_dir}{alone}")


def settings_config(path: str | Path | None, overrides: dict[str, Any], settings: dict[str, Any],
                    engine: str | None = None) -> Config:
    """The config of `fit`: YAML, then `section.key` overrides, then settings (FIT_SETTINGS' names;
    None: not given), then the engine."""
    unknown = sorted(set(settings) - set(FIT_SETTINGS))
    if unknown:
        raise UserError(f"unknown setting {', '.join(repr(name) for name in unknown)}: " + (
            _setting_hint(unknown[0]) or "use fit's flags as names (batch_size for --batch-size), or a config key in "
                                         "overrides (section.key)"))
    overrides = dict(overrides)
    for name, value in settings.items():
        setting = _BY_NAME[name]
        if setting.alone is not None and value == setting.alone:  # plain --resume
            value = True
        if setting.alone is not None and isinstance(value, str) and value not in setting.choices \
                and value.lower() not in ("true", "false"):  # the config's own words for a switch
            raise UserError(not_a_choice(setting, value, flag=False))
        if setting.repeatable and isinstance(value, (list, tuple)):
            value = ",".join(value) or None
        if value is not None:
            overrides[setting.key] = value
    for given, other in (("run.resume", "run.overwrite"), ("run.overwrite", "run.resume")):
        if overrides.get(given) and other not in overrides:  # the command line's way with the directory, not
            overrides[other] = False  # the file's other one (a saved run's config.yaml said resume: true)
    if engine is not None:
        overrides["train.engine"] = engine
    config = load_config(path, overrides)
    config.optim.refuse_keys_that_change_nothing()
    return config

"""hvdtrain from Python: `hvdtrain.fit` trains as `hvdtrain fit` does (the command is a layer over
`fit_from` here), taking objects too.

    import hvdtrain
    summary = hvdtrain.fit(model=Net(), data=(train_set, val_set), task="classification",
                           epochs=10, batch_size=64, run_dir="runs/exp1")

The same script runs alone or under any launcher, one process per GPU or CPU slot:

    python train.py
    horovodrun -np 4 python train.py          # the Horovod engine
    mpirun -np 4 python train.py
    torchrun --nproc-per-node 4 train.py      # the torch engine

dist: every rank runs the script and builds its own objects; rank 0's weights are broadcast
before the first step, so a model whose weights differ per rank starts from rank 0's.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from hvdtrain.cli import script_exit
from hvdtrain.config import FIT_SETTINGS, Config, default_part, saved_run_overrides, settings_config
from hvdtrain.errors import UserError

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.data import Dataset

    ModelLike = Union[str, "nn.Module", Callable[..., "nn.Module"]]
    DataLike = Union[str, "Dataset", "tuple[Dataset, Dataset]", Callable[[], Any]]

# The objects handed to `fit` in this process, named in the config as factories of this module
# (`hvdtrain.api:given.model`), so that they go the same way as a `package.module:function`.
given = SimpleNamespace()
GIVEN = "hvdtrain.api:given."


@script_exit.as_the_command_if_uncaught()
def fit(model: ModelLike | None = None, data: DataLike | None = None, task: Any = None, *,
        callbacks: Sequence[Any] = (), config: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
        engine: str | None = None, **settings: Any) -> dict[str, Any]:
    """Trains on every rank as `hvdtrain fit` does and returns the summary (also in summary.json), the
    same on every rank (rank 0's); a script that writes files of its own should write them on rank 0 only.

    model: a built-in name ('mlp', 'cnn'), a `package.module:function`, an `nn.Module`, or a function
        that builds one (given those of input_shape, num_classes, num_outputs it declares, num_classes
        if it takes **kwargs, and model.args; called after seeding with train.seed, as a factory is).
    data: a built-in name or a path, a `package.module:function`, a map-style Dataset (split into
        train and validation by data.val_fraction), a (train, val) pair of them, or a function of no
        arguments returning either.
    task: 'classification', 'regression', 'multilabel', 'language-model', a `package.module:attribute`,
        or your own object: a loss function loss(output, target), a loss module, or a task object.
    callbacks: objects with any of on_fit_start, on_step_end, on_epoch_end, on_checkpoint, on_fit_end
        (hvdtrain.train.callbacks), classes of them, or their names (`mymodule:MyCallback`, as --callback),
        called on every rank; `state.stop(reason)` stops every rank together.
    config: a YAML file, as `--config`; overrides: config keys, as `--set` ({'data.num_workers': 2}).
    engine: 'auto' (default), 'horovod', 'torch' or 'local', as `--engine`.
    settings: fit's flags by name (epochs=3, batch_size=64, lr=0.1, run_dir='runs/a', resume='auto', ...).
    """
    return fit_from(lambda: fit_config(model, data, task, callbacks, config, overrides, engine, settings))


def fit_from(make_config: Callable[[], Config], on_failure: Callable[[Exception], None] | None = None) -> dict[str, Any]:
    """What `hvdtrain.fit` and the command share: the config made, the engine it names started, the
    run trained; `on_failure(err)` sees a failure before the engine shuts down (`running_engine`)."""
    from hvdtrain.train import early_signals

    early_signals.hold()  # a scheduler's signal while starting stops at the first step, not kills
    try:
        cfg = make_config()

        from hvdtrain.engine import running_engine  # torch and horovod load only when training
        from hvdtrain.io.progress import say
        from hvdtrain.train.fit import fit as run_fit

        with running_engine(on_failure, kind=cfg.train.engine, device=cfg.train.device, threads=cfg.train.threads,
                            stall_timeout=cfg.train.stall_timeout, keep_freed_memory=cfg.train.keep_freed_memory,
                            timeline=cfg.run.horovod_timeline,
                            process_goes_on=not early_signals.in_the_command(), env_rendezvous=True) as started:
            if started.is_root:  # dist: one line, from rank 0
                for warning in cfg.warnings():
                    say(f"hvdtrain: warning: {warning}")
            return run_fit(cfg, started)
    finally:
        early_signals.restore()


def fit_config(model: Any, data: Any, task: Any, callbacks: Sequence[Any], config: str | Path | None,
               overrides: Mapping[str, Any] | None, engine: str | None, settings: dict[str, Any]) -> Config:
    """The Config that `fit` runs: objects become this module's factories, the rest as the command's."""
    for name in ("model", "data", "task", "callback"):
        if name in settings:
            raise UserError(f"{name} is fit's own argument here, not a setting"
                            + (": callbacks=[...]" if name == "callback" else ""))
    if split_data := sorted(set(settings) & _SPLIT_DATA_NAMES):  # Trainer(train_dataset=..., eval_dataset=...)
        raise UserError(f"fit takes its data as one argument, not {', '.join(split_data)}: "
                        "hvdtrain.fit(model, data=(train_set, val_set))")
    if settings.get("optimizer") is not None and not isinstance(settings["optimizer"], str):
        settings = {**settings, "optimizer": _optimizer(settings["optimizer"])}
    named = {"model": _model(model), "data": _data(data), "task": _task(task), "callback": _callbacks(callbacks)}
    return settings_config(config, dict(overrides or {}), {**settings, **named}, engine)


@script_exit.as_the_command_if_uncaught()
def evaluate(run_dir: str | Path, *, checkpoint: str = "best", data: DataLike | None = None, split: str | None = None,
             model: ModelLike | None = None, task: Any = None, batch_size: int | None = None,
             overrides: Mapping[str, Any] | None = None, device: str = "auto") -> dict[str, Any]:
    """A checkpoint's metrics, as `hvdtrain evaluate` (sharded over the ranks, reduced): on the run's
    validation data, or on `data` (all of it unless `split` says 'val' or 'train'). `model`, `data`
    and `task` objects stand in for those of a run trained from objects, which the command cannot
    rebuild; the model object is loaded with the checkpoint's weights."""
    from hvdtrain.after.inference import evaluate_run

    part = default_part(split, data is not None)
    return _on_saved_run(run_dir, checkpoint, data, model, task, batch_size, overrides, device,
                         lambda saved, engine: evaluate_run(saved, engine, part))


@script_exit.as_the_command_if_uncaught()
def predict(run_dir: str | Path, *, checkpoint: str = "best", data: DataLike | None = None, split: str | None = None,
            model: ModelLike | None = None, task: Any = None, batch_size: int | None = None, raw_outputs: bool = False,
            overrides: Mapping[str, Any] | None = None, device: str = "auto") -> Any:
    """One prediction per sample in the input's order, as `hvdtrain predict`: on rank 0 a tensor (a list
    of per-batch tensors where their shapes differ), None on the other ranks."""
    import torch

    from hvdtrain.after.inference import predict_run

    part = default_part(split, data is not None)
    found = _on_saved_run(run_dir, checkpoint, data, model, task, batch_size, overrides, device,
                          lambda saved, engine: predict_run(saved, engine, part, raw_outputs))
    if found is None:
        return None
    try:
        return torch.cat(found)
    except RuntimeError:  # padded sequences: each batch its own length
        return found


@script_exit.as_the_command_if_uncaught()
def export(run_dir: str | Path, *, format: str | None = None, output: str | Path | None = None,
           checkpoint: str = "best", data: DataLike | None = None, model: ModelLike | None = None,
           overrides: Mapping[str, Any] | None = None, device: str = "auto") -> Path | None:
    """The model as `hvdtrain export` writes it (safetensors, torchscript, pt2 or onnx: by default the one
    `output`'s name says, else safetensors), checked by loading it back on a batch of the data; rank 0
    writes and gets the path, the others None."""
    from hvdtrain.after import export as exporting
    from hvdtrain.after.inference import part_of
    from hvdtrain.data.loading import first_batch

    format = exporting.format_for(format, output)

    def work(saved: Any, engine: Any) -> Path | None:
        with engine.agree("export"):  # dist: rank 0 writes; a failure there stops every rank
            if not engine.is_root:
                return None
            dataset, collate = part_of(saved, default_part(None, data is not None), need_targets=False)
            batch = first_batch(dataset, saved.config.data.batch_size, collate, "export", engine.device)
            path = Path(output) if output else exporting.default_path(saved, format)
            return exporting.export(saved, format, path, batch).path

    return _on_saved_run(run_dir, checkpoint, data, model, None, None, overrides, device, work)


def _on_saved_run(run_dir: str | Path, checkpoint: str, data: Any, model: Any, task: Any, batch_size: int | None,
                  overrides: Mapping[str, Any] | None, device: str, work: Callable[[Any, Any], Any]) -> Any:
    """Opens the run on a started engine (every rank), runs `work(saved, engine)`, shuts down."""
    from hvdtrain.after.saved_run import open_run
    from hvdtrain.engine import running_engine
    from hvdtrain.train import early_signals

    settings = dict(overrides or {})
    for key, value in (("data.name", _data(data)), ("model.name", _model(model)), ("task.name", _task(task)),
                       ("data.batch_size", batch_size)):
        if value is not None:
            settings[key] = value
    with running_engine(device=device, process_goes_on=not early_signals.in_the_command()) as engine:
        return work(open_run(engine, run_dir, checkpoint, saved_run_overrides(settings, device)), engine)


def _model(model: Any) -> str | None:
    import torch

    if model is None or isinstance(model, str):
        return model
    if isinstance(model, torch.nn.Module):
        return _keep("model", lambda: model)
    if callable(model):
        return _keep("model", model)
    raise UserError(f"model must be an nn.Module, a function that builds one, or a name; got {type(model).__name__}")


def _data(data: Any) -> str | None:
    if data is None or isinstance(data, str):
        return data
    if isinstance(data, Path):
        return str(data)
    from hvdtrain.data.sources.user import instead_of_data, several_data_sets

    pair = data if isinstance(data, tuple) and len(data) == 2 else (data,)
    if any(type(part).__name__ == "Tensor" for part in pair):
        raise UserError("data takes Datasets, not tensors: wrap inputs and targets as "
                        "torch.utils.data.TensorDataset(x, y)")
    if all(_is_map_style(part) for part in pair) and not several_data_sets(data):
        return _keep("data", lambda: data)
    if callable(data) and not hasattr(data, "__len__"):
        return _keep("data", data)
    if instead := instead_of_data(data, "pass"):
        raise UserError(f"data got {instead}")
    raise UserError(f"data must be a map-style Dataset (with __getitem__ and __len__), a (train, val) pair of them, "
                    f"a function returning either, or a name or path; got {type(data).__name__}")


def _task(task: Any) -> str | None:
    if task is None or isinstance(task, str):
        return task
    if _is_map_style(task) and not isinstance(task, type):  # fit(model, train_set, val_set)
        raise UserError(f"task got a data set ({type(task).__name__}): give the training and validation sets as one "
                        "pair, hvdtrain.fit(model, (train_set, val_set))")
    return _keep("task", task)  # hvdtrain.tasks.user takes it in whichever form it comes


def _callbacks(callbacks: Any) -> list[str]:
    """Objects and classes kept as this module's, names (`mymodule:MyCallback`, as --callback) as they are;
    one alone as a list of one (a name would otherwise be taken letter by letter)."""
    from hvdtrain.train.callbacks import HOOKS

    if callbacks is None:
        return []
    alone = isinstance(callbacks, (str, type)) or any(hasattr(callbacks, hook) for hook in HOOKS)
    callbacks = [callbacks] if alone or not hasattr(callbacks, "__iter__") else list(callbacks)
    return [callback if isinstance(callback, str) else _keep(f"callback_{number}", callback)
            for number, callback in enumerate(callbacks)]


def _optimizer(optimizer: Any) -> str:
    """A torch.optim class or a factory function, kept as --optimizer's factory; not one already built."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"optimizer got an optimizer already built ({type(optimizer).__name__}): give its class "
                        f"(optimizer=torch.optim.{type(optimizer).__name__}, options in overrides={{'optim.args': "
                        "{...}}) or a function of (params, lr) that builds it; hvdtrain builds it with the learning "
                        "rate it scales")
    if not callable(optimizer):
        raise UserError(f"optimizer must be 'sgd', 'adamw', a 'package.module:function', a torch.optim class or a "
                        f"function that builds one; got {type(optimizer).__name__}")
    return _keep("optimizer", optimizer)


_SPLIT_DATA_NAMES = {"train_data", "val_data", "train_dataset", "val_dataset", "eval_dataset", "valid_dataset",
                     "validation_data", "train_set", "val_set", "train_loader", "val_loader", "train_dataloaders",
                     "val_dataloaders"}


def _is_map_style(part: Any) -> bool:
    return hasattr(part, "__getitem__") and hasattr(part, "__len__") and not isinstance(part, (str, bytes, Mapping))


def _keep(name: str, value: Any) -> str:
    setattr(given, name, value)
    return f"{GIVEN}{name}"


__all__ = ["FIT_SETTINGS", "evaluate", "export", "fit", "predict"]

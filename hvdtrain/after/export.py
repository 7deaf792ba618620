"""`export`: a checkpoint's model in a form other programs load, checked by loading it back.

    hvdtrain export runs/fit-1 --format safetensors    # weights; the config in the metadata
    hvdtrain export runs/fit-1 --format torchscript    # a traced program: torch.jit.load
    hvdtrain export runs/fit-1 --format pt2            # torch.export: torch.export.load
    hvdtrain export runs/fit-1 --format onnx           # needs pip install 'hvdtrain[onnx]'

Each export is written beside its final name, loaded back, and run on a real batch of
the run's data; only an export whose outputs match the checkpoint's model is renamed
into place, and the largest difference is reported.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from hvdtrain.data.batch import split_batch, takes_keyword, tensors_in
from hvdtrain.engine.base import extra_state, model_tensors, set_extra_state
from hvdtrain.io.atomic import WriteFailed, make_dir, shared_file_mode, why_not_written
from hvdtrain.errors import UserError, message_lines
from hvdtrain.after.saved_run import SavedRun

FORMATS = {"safetensors": ".safetensors", "torchscript": ".torchscript.pt", "pt2": ".pt2", "onnx": ".onnx"}
# Outputs of a reloaded export may differ from eager PyTorch by kernel choice, not more.
TOLERANCE = 1e-4


@dataclass
class Exported:
    path: Path
    max_abs_diff: float
    samples: int


# What a file's name says of the format written into it (--output without --format).
_NAMED = (("torchscript.pt", "torchscript"), ("torchscript", "torchscript"), ("safetensors", "safetensors"),
          ("onnx", "onnx"), ("pt2", "pt2"))
_UNSAID = (".pt", ".pth", ".bin", ".ckpt")  # torch's own names, for any of several formats


def format_for(fmt: str | None, output: str | Path | None) -> str:
    """The format to write: `fmt`, else the one `output`'s name says, else safetensors. A name saying
    another format than `fmt` (`--format onnx --output model.safetensors`), or none where `fmt` is not given
    (`model.pt`), is one line: the file would hold what its name does not say."""
    name = Path(output).name.lower() if output else ""
    suffix, named = next(((f".{suffix}", format) for suffix, format in _NAMED if name.endswith(f".{suffix}")),
                         ("", None))
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    if fmt is not None and named is not None and named != fmt:
        raise UserError(f"--format {fmt} and --output '{output}' disagree: its name says {named}; name it "
                        f"{str(output)[:-len(suffix)]}{FORMATS[fmt]}, or give --format {named}")
    if fmt is None and named is None and name.endswith(_UNSAID):
        raise UserError(f"--output '{output}' does not say which format to write: give --format "
                        f"({', '.join(FORMATS)}), or name it by its format ({', '.join('model' + s for s in FORMATS.values())})")
    return fmt or named or "safetensors"


def default_path(saved: SavedRun, fmt: str) -> Path:
    return saved.run_dir / "export" / f"model{FORMATS[fmt]}"


def export(saved: SavedRun, fmt: str, path: Path, batch: Any) -> Exported:
    """Writes the export, checks it on `batch` (the run's data, already split from nothing), moves it
    into place; nothing is left at `path` when a step fails."""
    args, kwargs = model_arguments(saved, batch)
    with torch.no_grad():
        expected = tensors_in(saved.model(*args, **kwargs))
    write, load = _WRITERS[fmt]
    make_dir(path.parent)
    try:
        staging = tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-")
    except OSError as err:  # a read-only or full file system where the folder is already there
        raise WriteFailed.of(path, err) from err
    with staging as scratch:
        staged = Path(scratch) / path.name
        try:
            with warnings.catch_warnings(), _quiet_logger("torch.onnx"):
                warnings.simplefilter("ignore")  # exporters warn at length about internals
                write(saved, staged, args, kwargs)
                got = tensors_in(load(saved, staged, args, kwargs))
        except UserError:
            raise
        except Exception as err:
            for partial in Path(scratch).iterdir():  # first, so that the free space said is what is left
                partial.unlink()
            reason = why_not_written(err, path.parent)
            if reason is not None:
                raise WriteFailed(path, reason) from err
            raise UserError(f"export to {fmt} failed: {type(err).__name__}: {message_lines(err)[:300]}; the model may use "
                            "Python that this format cannot capture (try another --format; safetensors holds any "
                            "model's weights)") from err
        diff = _largest_difference(expected, got, fmt)
        for produced in Path(scratch).iterdir():  # onnx may write an external data file beside
            produced.chmod(shared_file_mode())
            os.replace(produced, path.parent / produced.name)
    return Exported(path, diff, len(expected[0]) if expected and expected[0].dim() else 1)


def model_arguments(saved: SavedRun, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The batch's inputs as the model is called with them (see hvdtrain.data.batch)."""
    inputs, _ = split_batch(batch, saved.task.target_key)
    if isinstance(inputs, dict):
        key = saved.task.target_key
        return (), {k: v for k, v in inputs.items() if k != key or takes_keyword(saved.model, key)}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _largest_difference(expected: list[torch.Tensor], got: list[torch.Tensor], fmt: str) -> float:
    if len(expected) != len(got) or any(e.shape != g.shape for e, g in zip(expected, got)):
        raise UserError(f"the {fmt} export, loaded back, gave outputs of shapes {[tuple(g.shape) for g in got]} "
                        f"where the model gives {[tuple(e.shape) for e in expected]}: the export is not kept")
    diff = max((float((e.double() - g.double()).abs().max()) if e.numel() else 0.0
                for e, g in zip(expected, got)), default=0.0)
    if not diff <= TOLERANCE:
        raise UserError(f"the {fmt} export, loaded back, differs from the model by {diff:.3g} (more than "
                        f"{TOLERANCE}): the export is not kept")
    return diff


# --- formats: each writes a file and loads it back as something callable ------------


def _safetensors_write(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> None:
    from safetensors.torch import save_model

    metadata = {"format": "pt", "hvdtrain.config": json.dumps(saved.config.to_dict()),
                "hvdtrain.shapes": json.dumps(saved.shapes.to_dict()), "hvdtrain.task": saved.task.name,
                "hvdtrain.epoch": str(saved.epoch)}
    extra = extra_state(saved.model)
    for name, value in extra.items():  # a module's get_extra_state: no tensor, kept in the metadata as JSON
        try:
            kept = json.loads(json.dumps(value, allow_nan=False)) == value
        except (TypeError, ValueError):
            kept = False
        if not kept:
            raise UserError(f"the model's extra state '{name}' (its module's get_extra_state, a {type(value).__name__}) "
                            "does not come back the same from JSON, which is how a safetensors file keeps it: give "
                            "get_extra_state lists, dicts with string keys, strings and finite numbers")
    if extra:
        metadata["hvdtrain.extra_state"] = json.dumps(extra)
    save_model(_Tensors(saved.model), str(path), metadata=metadata)


class _Tensors:
    """A model as safetensors' save_model and load_model see it: its tensors, not its extra state (which
    they would take for tensors)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.load_state_dict = model.load_state_dict

    def state_dict(self) -> dict[str, torch.Tensor]:
        return model_tensors(self.model)


def _safetensors_load(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> Any:
    """A model built from the file's own metadata, with the file's weights."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    from hvdtrain.config import Config
    from hvdtrain.models import ModelShapes, unwrapped

    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    config = Config.from_dict(json.loads(metadata["hvdtrain.config"]))
    model = unwrapped(ModelShapes.from_dict(json.loads(metadata["hvdtrain.shapes"])).build(config.model))
    missing, unexpected = load_model(_Tensors(model), str(path), strict=False)
    missing = set(missing) - set(extra_state(model))  # set from the metadata below
    if missing or unexpected:
        raise RuntimeError(f"the file's tensors do not fit the model: missing {sorted(missing)}, unexpected "
                           f"{sorted(unexpected)}")
    set_extra_state(model, json.loads(metadata.get("hvdtrain.extra_state", "{}")))
    return _call(model.to(_device_of(args, kwargs)).eval(), args, kwargs)


def _in_memory(save: Callable[[io.BytesIO], None]) -> bytes:
    """What `save` writes, made in memory and then written by Python: torch's archive writer, writing a
    file itself, aborts the whole process when the disk fills (its destructor throws)."""
    buffer = io.BytesIO()
    save(buffer)
    return buffer.getvalue()


def _torchscript_write(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> None:
    traced = torch.jit.trace(saved.model, args, example_kwarg_inputs=kwargs or None, strict=False)
    path.write_bytes(_in_memory(lambda buffer: torch.jit.save(traced, buffer)))


def _torchscript_load(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> Any:
    return _call(torch.jit.load(str(path), map_location=_device_of(args, kwargs)), args, kwargs)


def _pt2_write(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> None:
    program = torch.export.export(saved.model, args, kwargs, dynamic_shapes=_batch_dynamic(args, kwargs))
    path.write_bytes(_in_memory(lambda buffer: torch.export.save(program, buffer)))


def _pt2_load(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> Any:
    return _call(torch.export.load(str(path)).module(), args, kwargs)


def _onnx_write(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> None:
    _need("onnx", "onnxscript", "onnxruntime")
    torch.onnx.export(saved.model, args, str(path), kwargs=kwargs or None, dynamo=True,
                      dynamic_shapes=_batch_dynamic(args, kwargs), verbose=False)


def _onnx_load(saved: SavedRun, path: Path, args: tuple, kwargs: dict) -> Any:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    values = [t.detach().cpu().numpy() for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
    feeds = {spec.name: value for spec, value in zip(session.get_inputs(), values)}
    return [torch.from_numpy(out) for out in session.run(None, feeds)]


_WRITERS: dict[str, tuple[Callable[..., None], Callable[..., Any]]] = {
    "safetensors": (_safetensors_write, _safetensors_load),
    "torchscript": (_torchscript_write, _torchscript_load),
    "pt2": (_pt2_write, _pt2_load),
    "onnx": (_onnx_write, _onnx_load),
}


def _call(model: Any, args: tuple, kwargs: dict) -> Any:
    with torch.no_grad():
        return model(*args, **kwargs)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    found = tensors_in((args, kwargs))
    return found[0].device if found else torch.device("cpu")


def _batch_dynamic(args: tuple, kwargs: dict) -> Any:
    """The leading (batch) dimension of every input tensor may vary in the exported program
    (static shapes when the model takes positional and keyword inputs together)."""
    def spec(value: Any) -> Any:
        return {0: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() else None

    if args and kwargs:
        return None
    return {name: spec(value) for name, value in kwargs.items()} if kwargs else tuple(spec(a) for a in args)


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _need(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"--format onnx needs {', '.join(missing)}: pip install 'hvdtrain[onnx]' "
                        "(onnx, onnxscript and onnxruntime)")

"""A run directory opened after `fit`: its config and a verified checkpoint's model, on every rank.

    hvdtrain evaluate runs/fit-1                       # best.pt, on the run's validation data
    hvdtrain export runs/fit-1 --checkpoint last

Rank 0 reads the checkpoint (the run directory need not be shared between hosts) and
checks it against the manifest's sha256; every rank rebuilds the model from the
checkpoint's config and shapes and takes rank 0's weights by broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvdtrain.io.checkpoint import MANIFEST, NAMED, CheckpointStore, sha256_of
from hvdtrain.config import Config
from hvdtrain.data.sources import build_data
from hvdtrain.engine import Engine
from hvdtrain.errors import UserError, message_lines
from hvdtrain.model_layout import check_same_model
from hvdtrain.models import ModelShapes, load_weights, unwrapped
from hvdtrain.tasks import Task, build_task
from hvdtrain.train.lazy_modules import has_lazy_layers


@dataclass
class SavedRun:
    run_dir: Path
    checkpoint: Path
    config: Config
    """The checkpoint's config with the command's overrides (data, batch size, device) applied."""
    epoch: int
    shapes: ModelShapes
    task: Task
    model: nn.Module
    """On the engine's device, in eval mode, with the checkpoint's weights."""


def open_run(engine: Engine, run_dir: str | Path, which: str = "best",
             overrides: dict[str, Any] | None = None) -> SavedRun:
    """The run's model with the checkpoint's weights on every rank (collective: call it on all)."""
    run_dir = Path(run_dir)
    with engine.agree("checkpoint"):  # dist: rank 0 alone reads the checkpoint
        state = read_checkpoint(run_dir, which) if engine.is_root else None
        meta = _meta(state) if state is not None else None
    meta = engine.broadcast_object(meta, "checkpoint_meta")
    with engine.agree("model"):
        config = Config.from_dict(meta["config"], overrides)
        task = build_task(config.task)
        shapes = ModelShapes.from_dict(meta["shapes"])
        torch.manual_seed(config.train.seed)
        model = unwrapped(shapes.build(config.model))  # a factory's torch.compile: its plain module, as fit saved
        if state is not None:
            _load_weights(model, state["model"], meta["path"])
        model = model.to(engine.device).eval()
        lazy = has_lazy_layers(model) and not engine.is_root
    if engine.allgather_object(lazy, "lazy_layers")[1:] != [False] * (engine.size - 1):
        # dist: lazy layers (nn.LazyLinear) got their shapes from the checkpoint's weights, on rank 0 alone
        shapes_of = engine.broadcast_object({name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
                                             if isinstance(t, torch.Tensor)} if engine.is_root else None,
                                            "lazy_layer_shapes")  # a module's extra state is no tensor
        if lazy:
            model.load_state_dict({name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in shapes_of.items()},
                                  strict=False)
    check_same_model(model, engine)  # dist: a factory may build another model on some rank
    engine.broadcast_parameters(model)  # dist: every rank holds rank 0's weights
    return SavedRun(run_dir, Path(meta["path"]), config, meta["epoch"], shapes, task, model)


def read_checkpoint(run_dir: Path, which: str) -> dict[str, Any]:
    """The checkpoint `which` names (best, last or a path), verified; rank 0 only."""
    path = checkpoint_path(run_dir, which)
    state = CheckpointStore.load(path, optimizer=False)  # the weights: a sharded optimizer's pieces are not needed
    if "config" not in state:
        raise UserError(f"checkpoint '{path}' holds no config: it was written by an older hvdtrain; "
                        "train it again with this version")
    state["_path"] = str(path)
    return state


def checkpoint_path(run_dir: Path, which: str) -> Path:
    if which not in NAMED:
        path = Path(which).expanduser()
        store = CheckpointStore(run_dir)
        kept = [store.dir / name for name in (which, f"{which}.pt")]  # `epoch-0003`: one of the run's own
        if not path.is_file() and any(candidate.is_file() for candidate in kept):
            return _intact(store, next(candidate for candidate in kept if candidate.is_file()).name)
        if not path.is_file():
            names = sorted(candidate.stem for candidate in store.dir.glob("*.pt")) if store.dir.is_dir() else []
            held = f" (the run's: {', '.join(names)})" if names else ""
            raise UserError(f"checkpoint '{which}' does not exist: pass best, last, the name of one in the run's "
                            f"checkpoints{held} or the path of a checkpoint file")
        return path
    if not run_dir.is_dir():
        raise UserError(f"run directory '{run_dir}' does not exist: pass the --run-dir of a finished `hvdtrain fit`")
    store = CheckpointStore(run_dir)
    path = store.named(which)
    if not path.is_file():
        runs = sorted(str(found.parent.parent.relative_to(run_dir)) for found in run_dir.glob(f"*/*/{path.name}"))
        if runs:  # a folder of runs, as `runs/` is
            listed = ", ".join(runs[:5]) + (", ..." if len(runs) > 5 else "")
            raise UserError(f"'{run_dir}' is no run directory but holds {len(runs)}: {listed}; pass one of them "
                            f"(`hvdtrain runs {run_dir}` lists them)")
        raise UserError(f"'{run_dir}' has no checkpoints ({path} is missing): pass the run directory of a `fit` "
                        "that finished at least one epoch")
    return _intact(store, which)


def _intact(store: CheckpointStore, which: str) -> Path:
    """The checkpoint `which` (best, last or a kept file's name), checked against the manifest's sha256."""
    path = store.named(which) if which in NAMED else store.dir / which
    expected = store.recorded_sha256(which)
    if expected is not None and sha256_of(path) != expected:
        raise UserError(f"checkpoint '{path}' is corrupt or truncated (its sha256 does not match {MANIFEST}): pass "
                        f"--checkpoint with an intact one from {store.dir}")
    return path


def _meta(state: dict[str, Any]) -> dict[str, Any]:
    """What every rank needs to rebuild the model (small: no tensors)."""
    shapes = state.get("shapes")
    if shapes is None:  # written before checkpoints recorded shapes: read them off the data
        config = Config.from_dict(state["config"])
        split = build_data(config.data, config.train.seed, config.task.target_key)
        task = build_task(config.task)
        shapes = ModelShapes(split.input_shape, split.num_classes,
                             task.num_outputs(split.num_classes, split.target_shape)).to_dict()
    return {"config": state["config"], "shapes": shapes, "epoch": int(state["epoch"]), "path": state["_path"]}


def _load_weights(model: nn.Module, weights: dict[str, torch.Tensor], path: str) -> None:
    try:
        load_weights(model, weights)
    except RuntimeError as err:
        raise UserError(f"checkpoint '{path}' does not fit the model its config builds: "
                        f"{message_lines(err, 2)}; was the model's code changed since?") from err

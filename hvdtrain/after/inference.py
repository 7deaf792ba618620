"""`evaluate` and `predict`: a saved model over a data set, sharded by rank, each sample once.

    horovodrun -np 2 hvdtrain evaluate runs/fit-1 --data test.npz
    horovodrun -np 2 hvdtrain predict runs/fit-1 --data new.npz --output predictions.npy
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from hvdtrain.data.augment import prepared_batches
from hvdtrain.data.batch import to_device
from hvdtrain.io.atomic import atomic_write
from hvdtrain.data.loading import batches, collate_function, first_batch, seeded_for_data
from hvdtrain.data.sources import build_part
from hvdtrain.engine import Engine
from hvdtrain.errors import UserError
from hvdtrain.train.failures import located
from hvdtrain.train.loop import evaluate
from hvdtrain.numerics.precision import Precision
from hvdtrain.data.sampler import EvalShardSampler, FixedBatchesByRank
from hvdtrain.after.saved_run import SavedRun
from hvdtrain.same_samples import check_same_samples
from hvdtrain.tasks import predictions
from hvdtrain.tasks.check import check_first_batch, guarded

PREDICTION_FORMATS = (".npy", ".pt", ".jsonl")


def part_of(saved: SavedRun, part: str, need_targets: bool = True) -> tuple[Dataset, Any]:
    """The data set part to run over (with the run's data config and the command's overrides),
    and the run's collate function for it."""
    cfg = saved.config
    seeded_for_data(cfg.train.seed)  # as fit made it
    dataset = build_part(cfg.data, cfg.train.seed, saved.task.target_key, part, need_targets)
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise UserError(f"data set '{cfg.data.name}' ({part}) has no samples")
    return dataset, collate_function(cfg.data.collate, cfg.task.ignore_index, saved.task.target_key)


def evaluate_run(saved: SavedRun, engine: Engine, part: str) -> dict[str, Any]:
    """The task's metrics over every sample of the part, each counted once across ranks."""
    cfg = saved.config
    precision = Precision(cfg.train.precision, engine.device)
    made = engine.made_in_turn(lambda: part_of(saved, part)) if cfg.data.in_turn else None  # dist: fetched once
    with engine.agree("data"):
        dataset, collate = made or part_of(saved, part)
        first = first_batch(dataset, cfg.data.batch_size, collate, "evaluation", engine.device)
        held = dataset.tensors[-1] if isinstance(dataset, TensorDataset) and len(dataset.tensors) > 1 else None
        template = check_first_batch(saved.task, saved.model, first, held, precision, "evaluation").template
    with engine.agree("data_alike"):
        check_same_samples({part: dataset}, engine)  # dist: or ranks would count other samples
    sampler = EvalShardSampler(len(dataset), cfg.data.batch_size, engine.rank, engine.size)  # dist
    loaded = Counted(prepared_batches(batches(dataset, sampler, 0, False, collate), dataset, engine.device), len(sampler))
    with loaded.failures_located(engine, "evaluation"):
        result = evaluate(saved.model, engine, saved.task, loaded, template, precision, cfg.train.channels_last)
    return {"run_dir": str(saved.run_dir), "checkpoint": str(saved.checkpoint), "epoch": saved.epoch,
            "data": cfg.data.name, "part": part, "samples": result.samples, "world_size": engine.size,
            **result.metrics}


class Predictions(list):
    """Per-batch prediction tensors, in input order; `files`: each sample's file, where the data names them;
    `classes`: the name of each class, where the data names them (class folders, torchvision's datasets)."""

    def __init__(self, per_batch: list[torch.Tensor], files: list[str] | None = None,
                 classes: list[str] | None = None):
        super().__init__(per_batch)
        self.files, self.classes = files, classes


@torch.no_grad()
def predict_run(saved: SavedRun, engine: Engine, part: str, raw: bool) -> list[torch.Tensor] | None:
    """One prediction per sample in the input's order, on rank 0 (None elsewhere): the task's
    answer, or with `raw` the model's output. Batches are the same for any world size."""
    cfg = saved.config
    precision = Precision(cfg.train.precision, engine.device)
    made = engine.made_in_turn(lambda: part_of(saved, part, need_targets=False)) if cfg.data.in_turn else None
    with engine.agree("data"):
        dataset, collate = made or part_of(saved, part, need_targets=False)
        first = first_batch(dataset, cfg.data.batch_size, collate, "prediction", engine.device)
        # dist: data that does not fit the model fails here, on every rank, with one line
        guarded(saved.task, "the model's forward", lambda: _predicted(saved, first, precision, raw), first,
                "prediction")
    with engine.agree("data_alike"):
        check_same_samples({part: dataset}, engine)  # dist: or rank 0 would put others' predictions in its order
    sampler = FixedBatchesByRank(len(dataset), cfg.data.batch_size, engine.rank, engine.size)  # dist
    mine = []
    loaded = Counted(prepared_batches(batches(dataset, sampler, 0, False, collate), dataset, engine.device),
                     len(sampler.batch_numbers))
    with loaded.failures_located(engine, "prediction"):
        for number, batch in zip(sampler.batch_numbers, loaded):
            batch = to_device(batch, engine.device, cfg.train.channels_last)
            mine.append((number, _predicted(saved, batch, precision, raw).cpu()))
        everyone = engine.gather_object(mine, "predictions")  # dist: rank 0 puts them in input order
    if everyone is None:
        return None
    files = [dataset.file(i) for i in range(len(dataset))] if hasattr(dataset, "file") else None
    classes = getattr(dataset, "classes", None)
    return Predictions([tensor for _, tensor in sorted(pair for rank_part in everyone for pair in rank_part)], files,
                       [str(name) for name in classes] if isinstance(classes, (list, tuple)) and not raw else None)


class Counted:
    """This rank's batches, counted from when each is asked for: where in them a failure came, as one
    was made or used."""

    def __init__(self, batches: Iterable[Any], total: int):
        self.batches, self.total, self.at = batches, total, 0

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batches)
        while True:
            self.at += 1
            try:
                batch = next(iterator)
            except StopIteration:
                self.at -= 1
                return
            yield batch

    @contextmanager
    def failures_located(self, engine: Engine, stage: str) -> Iterator[None]:
        """A failure of the user's code on this rank becomes its one line (as fit's mid-run failures);
        a collective that broke off, as another rank failed, is left for the command to say so."""
        try:
            yield
        except Exception as err:
            raise located(err, engine, f"{stage}, batch {self.at} of its {self.total}")


def _predicted(saved: SavedRun, batch: Any, precision: Precision, raw: bool) -> torch.Tensor:
    task = saved.task
    with precision.autocast():
        output, _ = task.forward(saved.model, batch)
    found = predictions(output) if raw else task.predict(output)
    if not isinstance(found, torch.Tensor) or found.dim() == 0:
        raise UserError(f"task {task.name} found no per-sample predictions in the model's output (a model that "
                        "returns only its loss has none): return the outputs too, e.g. a dict with 'loss' and "
                        "'logits'")
    return found.float() if found.dtype in (torch.float16, torch.bfloat16) else found


def check_prediction_path(path: str) -> Path:
    """Before any work: the output's format from its suffix, and a directory to write it in."""
    output = Path(path)
    if output.suffix not in PREDICTION_FORMATS:
        raise UserError(f"--output '{path}' must end in {', '.join(PREDICTION_FORMATS)} (the file's format)")
    if output.is_dir():
        raise UserError(f"--output '{path}' is a directory: name a file")
    if not output.parent.is_dir():
        raise UserError(f"--output '{path}': directory '{output.parent}' does not exist")
    return output


def write_predictions(path: Path, per_batch: list[torch.Tensor]) -> tuple[int, str]:
    """Writes the predictions atomically; returns (samples, shape description)."""
    samples = [row for tensor in per_batch for row in tensor]
    same_shape = len({tuple(t.shape[1:]) for t in per_batch}) == 1
    if path.suffix == ".jsonl":
        files, classes = getattr(per_batch, "files", None), getattr(per_batch, "classes", None)
        named = (lambda i: {"file": files[i]}) if files else (lambda i: {})

        def class_of(row: torch.Tensor) -> dict[str, str]:  # a class number, and the data names its classes
            if classes and row.dim() == 0 and not row.is_floating_point() and 0 <= int(row) < len(classes):
                return {"class": classes[int(row)]}
            return {}

        text = "".join(json.dumps({"index": i, **named(i), "prediction": row.tolist(), **class_of(row)},
                                  ensure_ascii=False) + "\n"
                       for i, row in enumerate(samples))
        atomic_write(path, lambda handle: handle.write(text.encode()))
    elif path.suffix == ".pt":
        value = torch.cat(per_batch) if same_shape else samples
        atomic_write(path, lambda handle: torch.save(value, handle))
    else:
        if not same_shape:
            raise UserError(f"the predictions differ in shape from batch to batch (padded sequences: "
                            f"{sorted({tuple(t.shape[1:]) for t in per_batch})[:3]}...): an .npy file holds one "
                            "array; write .pt or .jsonl instead")
        array = torch.cat(per_batch).numpy()
        atomic_write(path, lambda handle: np.save(handle, array))
    shape = f"{len(samples)} x {tuple(per_batch[0].shape[1:])}" if same_shape else f"{len(samples)} samples"
    return len(samples), shape

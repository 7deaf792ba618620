"""Data sets: the built-ins, `.npz` files and user factories, and how batches reach the loop.

A user's own `torch.utils.data.Dataset` works unchanged (through a factory), whatever
its samples hold (see hvdtrain.batch); data held in tensors takes a faster path that
gathers a whole batch with one index operation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler, TensorDataset, default_collate

from hvdtrain.batch import split_batch

from hvdtrain.config import DataConfig
from hvdtrain.engine import Engine, available_cores
from hvdtrain.errors import UserError
from hvdtrain.factory import call_factory, is_factory_path, resolve_factory

BUILT_IN = ("digits", "random")


@dataclass
class DataSplit:
    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...] | None
    """One sample's input shape; None when the input is not one tensor (several, or a dict)."""
    num_classes: int | None
    """None when it cannot be read off the data (a factory's Dataset without `classes`)."""
    target_shape: tuple[int, ...] | None = None
    """One sample's target shape (() for a class label); None when there is none."""
    held_targets: torch.Tensor | None = None
    """Every target, when the data set holds them in memory (to check labels once)."""
    target_dtype: torch.dtype | None = None
    """One sample's target dtype; None when there is no target tensor."""


def build_data(cfg: DataConfig, seed: int, target_key: str = "labels") -> DataSplit:
    """The train and validation sets the config names; the same on every rank."""
    split = _build(cfg, seed, target_key)
    if cfg.num_classes is not None:  # the user's word wins over what the data suggests
        split.num_classes = cfg.num_classes
    return split


def _build(cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
    if _is_factory(cfg):
        return _from_factory(cfg, seed, target_key)
    x, y = _tensors(cfg, seed)
    split = _split_tensors(x, y, cfg.val_fraction, seed)
    return _standardized(split) if cfg.name == "digits" else split


def _is_factory(cfg: DataConfig) -> bool:
    return is_factory_path(cfg.name) and not cfg.name.endswith(".npz")  # a path with a colon can be a file


PARTS = ("val", "train", "all")


def build_part(cfg: DataConfig, seed: int, target_key: str, part: str, need_targets: bool = True) -> Dataset:
    """One part of a data set for evaluation or prediction: the `train` or `val` split as `fit`
    made it, or `all` of it in the source's own order (a factory's (train, val) pair: train first).
    Without `need_targets`, an .npz file may hold only `x`."""
    if part not in PARTS:
        raise UserError(f"unknown data part '{part}': use one of {', '.join(PARTS)}")
    if part != "all":
        return getattr(build_data(cfg, seed, target_key), part)
    if _is_factory(cfg):
        made = call_factory(cfg.name, "data set", {})
        if isinstance(made, tuple) and len(made) == 2:
            return ConcatDataset(list(made))
        return made
    x, y = _tensors(cfg, seed, need_targets)
    if cfg.name == "digits":  # standardized with the training part's statistics, as fit saw it
        mean, std = _input_statistics(_split_tensors(x, y, cfg.val_fraction, seed).train.tensors[0])
        x = (x - mean) / std
    return TensorDataset(x) if y is None else TensorDataset(x, y)


def _tensors(cfg: DataConfig, seed: int, need_targets: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inputs and targets of the in-memory sources, in their own order."""
    if cfg.name == "digits":
        return _digits()
    if cfg.name == "random":
        return _random_teacher(cfg.samples, cfg.features, cfg.classes, seed)
    if cfg.name.endswith(".npz"):
        return _npz(Path(cfg.name), need_targets)
    raise UserError(
        f"unknown data set '{cfg.name}': use one of {', '.join(BUILT_IN)}, a path to an .npz file, "
        "or package.module:function"
    )


def data_workers(requested: int, dataset: Dataset, engine: Engine) -> int:
    """DataLoader workers per process: as asked, or a choice that keeps the cores for compute."""
    if requested >= 0:
        return requested
    if isinstance(dataset, TensorDataset) or engine.device.type != "cuda":
        return 0  # in memory or CPU training: workers would only take cores from the compute
    # dist: the host's cores are shared by its local processes; leave one for the main thread.
    return max(0, min(4, available_cores() // engine.local_size - 1))


def batches(dataset: Dataset, sampler: Sampler[list[int]] | list[list[int]], num_workers: int, pin_memory: bool,
            collate: Callable[[list[Any]], Any] | None = None) -> Iterable:
    """Batches in the order `sampler` gives (an iterable that can be re-iterated each epoch)."""
    if isinstance(dataset, TensorDataset) and num_workers == 0 and collate is None:
        return _TensorBatches(dataset.tensors, sampler)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, collate_fn=collate)


def collate_function(name: str | None, ignore_index: int, target_key: str) -> Callable[[list[Any]], Any] | None:
    """data.collate: None (PyTorch's default), `pad`, or the user's `package.module:function`."""
    if name is None:
        return None
    if name == "pad":
        return functools.partial(pad_collate, ignore_index=ignore_index, target_key=target_key)
    return resolve_factory(name, "collate")


def pad_collate(samples: list[Any], ignore_index: int = -100, target_key: str = "labels") -> Any:
    """A batch of variable-length sequences, each field padded to the longest in the batch.

    Targets (the last element of a tuple sample, the target key of a dict sample) are
    padded with `ignore_index`, so padding is never scored; inputs with 0. A sample that
    is one sequence becomes (input padded with 0, target padded with ignore_index), the
    form the language-model task reads.
    """
    first = samples[0]
    if isinstance(first, dict):
        return {key: _padded([s[key] for s in samples], ignore_index if key == target_key else 0) for key in first}
    if isinstance(first, (tuple, list)):
        last = len(first) - 1
        return tuple(_padded([s[i] for s in samples], ignore_index if i == last and last > 0 else 0)
                     for i in range(len(first)))
    return _padded(samples, 0), _padded(samples, ignore_index)


def _padded(values: list[Any], pad_value: int) -> Any:
    if not all(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
        return default_collate(values)
    tensors = [torch.as_tensor(v) for v in values]
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors)
    return pad_sequence(tensors, batch_first=True, padding_value=pad_value)


class _TensorBatches:
    """One gather per batch instead of one `__getitem__` call and a collate per sample."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], sampler: Sampler[list[int]]):
        self.tensors, self.sampler = tensors, sampler

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for indices in self.sampler:
            index = torch.as_tensor(indices)
            yield tuple(t[index] for t in self.tensors)


# --- sources -------------------------------------------------------------------


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # ships inside scikit-learn's wheel

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    return x, torch.from_numpy(digits.target.astype(np.int64))


def _random_teacher(samples: int, features: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Gaussian inputs labelled by a fixed random linear teacher: learnable, unlike random labels.
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    return x, (x @ teacher).argmax(dim=1)


def _npz(path: Path, need_targets: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not path.is_file():
        raise UserError(f"data file '{path}' does not exist: check data.name (--data)")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            missing = [k for k in ("x", "y") if k not in arrays.files and (need_targets or k == "x")]
            if missing:
                raise UserError(
                    f"data file '{path}' has no array {' or '.join(repr(k) for k in missing)} "
                    f"(it has {', '.join(arrays.files) or 'none'}): save it with np.savez(path, x=inputs, y=labels)"
                )
            x, y = arrays["x"], arrays["y"] if "y" in arrays.files else None
    except (OSError, ValueError) as err:
        raise UserError(f"data file '{path}' is not a readable .npz file ({err}): write it with np.savez") from err
    if not np.issubdtype(x.dtype, np.number):
        raise UserError(f"data file '{path}': x must be numeric, got dtype {x.dtype}")
    inputs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if y is None:
        return inputs, None
    if len(x) != len(y):
        raise UserError(f"data file '{path}': x has {len(x)} samples but y has {len(y)}: they must match")
    if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
        raise UserError(f"data file '{path}': y must hold class labels or numbers, got dtype {y.dtype}")
    # Integer labels stay integers (classification); anything else becomes float32 (regression, multilabel).
    targets = y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else np.ascontiguousarray(y, dtype=np.float32)
    return inputs, torch.from_numpy(targets)


def _from_factory(cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
    made = call_factory(cfg.name, "data set", {})
    if isinstance(made, tuple) and len(made) == 2:
        train, val = made
    elif isinstance(made, Dataset):
        train, val = _random_split(made, cfg.val_fraction, seed)
    else:
        raise UserError(
            f"data factory '{cfg.name}' returned {type(made).__name__}: "
            "return a torch Dataset or a (train, val) pair of them"
        )
    for part, name in ((train, "train"), (val, "val")):
        if not hasattr(part, "__getitem__") or not hasattr(part, "__len__"):
            raise UserError(f"data factory '{cfg.name}': its {name} set is not a map-style Dataset (needs __getitem__ "
                            "and __len__): hvdtrain shards by index so that every rank gets the same number of "
                            "batches; return a map-style Dataset (an IterableDataset cannot be sharded evenly)")
    if len(train) == 0 or len(val) == 0:
        raise UserError(f"data factory '{cfg.name}' gave an empty {'train' if len(train) == 0 else 'val'} set")
    inputs, target = split_batch(train[0], target_key)
    dtype = torch.as_tensor(target).dtype if _shape_of(target) is not None else None
    return DataSplit(train, val, _shape_of(inputs), _num_classes(train, val), _shape_of(target),
                     _held_targets(train, val), dtype)


def _shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of a tensor-like value (a number has shape ()); None for anything else."""
    if isinstance(value, (torch.Tensor, np.ndarray, int, float)) and not isinstance(value, bool):
        return tuple(torch.as_tensor(value).shape)
    return None


def _held_targets(*datasets: Dataset) -> torch.Tensor | None:
    """Every target of data sets that hold them in tensors (a TensorDataset, or `targets`)."""
    held = []
    for dataset in datasets:
        base = getattr(dataset, "dataset", dataset)  # through a Subset: the whole set, a superset
        found = base.tensors[-1] if isinstance(base, TensorDataset) and len(base.tensors) > 1 else getattr(base, "targets", None)
        if found is None:
            return None
        try:
            held.append(torch.as_tensor(found).reshape(-1))
        except (TypeError, ValueError, RuntimeError):
            return None
    return torch.cat(held) if held else None


def _num_classes(*datasets: Dataset) -> int | None:
    """From a `num_classes` or `classes` attribute, else from integer labels held in memory."""
    labels = []
    for dataset in datasets:
        base = getattr(dataset, "dataset", dataset)  # through a Subset
        if hasattr(base, "num_classes"):
            return int(base.num_classes)
        if hasattr(base, "classes"):
            return len(base.classes)
        held = base.tensors[-1] if isinstance(base, TensorDataset) and len(base.tensors) > 1 else getattr(base, "targets", None)
        if held is not None:
            held = torch.as_tensor(held)
            if held.dtype.is_floating_point or held.numel() == 0:
                return None
            labels.append(int(held.max()))
    return max(labels) + 1 if labels else None


# --- splitting -----------------------------------------------------------------


def _split_tensors(x: torch.Tensor, y: torch.Tensor, val_fraction: float, seed: int) -> DataSplit:
    if len(x) < 2:
        raise UserError(f"the data set has {len(x)} sample(s): at least 2 are needed for train and validation")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = min(len(x) - 1, max(1, round(len(x) * val_fraction)))
    val_idx, train_idx = order[:n_val], order[n_val:]
    labels = not (y.is_floating_point() or y.dtype == torch.bool)
    return DataSplit(
        TensorDataset(x[train_idx], y[train_idx]),
        TensorDataset(x[val_idx], y[val_idx]),
        tuple(x.shape[1:]),
        int(y.max()) + 1 if labels else None,
        tuple(y.shape[1:]),
        y,
        y.dtype,
    )


def _standardized(split: DataSplit) -> DataSplit:
    """Zero mean, unit variance per input feature, with statistics from the training part only."""
    train_x, train_y = split.train.tensors  # type: ignore[attr-defined]
    val_x, val_y = split.val.tensors  # type: ignore[attr-defined]
    mean, std = _input_statistics(train_x)
    split.train = TensorDataset((train_x - mean) / std, train_y)
    split.val = TensorDataset((val_x - mean) / std, val_y)
    return split


def _input_statistics(train_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return train_x.mean(dim=0), train_x.std(dim=0).clamp_min(0.1)  # border pixels are almost always 0


def _random_split(dataset: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    n = len(dataset)  # type: ignore[arg-type]
    if n < 2:
        raise UserError(f"the data set has {n} sample(s): at least 2 are needed for train and validation")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    val, train = torch.utils.data.random_split(dataset, [n_val, n - n_val], generator=torch.Generator().manual_seed(seed))
    return train, val

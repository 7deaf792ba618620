"""Data sets: the built-ins, `.npz` files and user factories, and how batches reach the loop.

A user's own `torch.utils.data.Dataset` works unchanged (through a factory); data held
in tensors takes a faster path that gathers a whole batch with one index operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from hvdtrain.config import DataConfig
from hvdtrain.engine import Engine, available_cores
from hvdtrain.errors import UserError
from hvdtrain.factory import call_factory, is_factory_path

BUILT_IN = ("digits", "random")


@dataclass
class DataSplit:
    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...]
    num_classes: int | None
    """None when it cannot be read off the data (a factory's Dataset without `classes`)."""


def build_data(cfg: DataConfig, seed: int) -> DataSplit:
    """The train and validation sets the config names; the same on every rank."""
    if cfg.name == "digits":
        x, y = _digits()
        return _standardized(_split_tensors(x, y, cfg.val_fraction, seed))
    if cfg.name == "random":
        x, y = _random_teacher(cfg.samples, cfg.features, cfg.classes, seed)
        return _split_tensors(x, y, cfg.val_fraction, seed)
    if cfg.name.endswith(".npz"):
        x, y = _npz(Path(cfg.name))
        return _split_tensors(x, y, cfg.val_fraction, seed)
    if is_factory_path(cfg.name):
        return _from_factory(cfg, seed)
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


def batches(dataset: Dataset, sampler: Sampler[list[int]], num_workers: int, pin_memory: bool) -> Iterable:
    """Batches in the order `sampler` gives (an iterable that can be re-iterated each epoch)."""
    if isinstance(dataset, TensorDataset) and num_workers == 0:
        return _TensorBatches(dataset.tensors, sampler)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0)


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


def _npz(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    if not path.is_file():
        raise UserError(f"data file '{path}' does not exist: check data.name (--data)")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            missing = [k for k in ("x", "y") if k not in arrays.files]
            if missing:
                raise UserError(
                    f"data file '{path}' has no array {' or '.join(repr(k) for k in missing)} "
                    f"(it has {', '.join(arrays.files) or 'none'}): save it with np.savez(path, x=inputs, y=labels)"
                )
            x, y = arrays["x"], arrays["y"]
    except (OSError, ValueError) as err:
        raise UserError(f"data file '{path}' is not a readable .npz file ({err}): write it with np.savez") from err
    if len(x) != len(y):
        raise UserError(f"data file '{path}': x has {len(x)} samples but y has {len(y)}: they must match")
    if not np.issubdtype(y.dtype, np.integer):
        raise UserError(f"data file '{path}': y must hold integer class labels, got dtype {y.dtype}")
    if not np.issubdtype(x.dtype, np.number):
        raise UserError(f"data file '{path}': x must be numeric, got dtype {x.dtype}")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))


def _from_factory(cfg: DataConfig, seed: int) -> DataSplit:
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
    sample = train[0]
    if not isinstance(sample, (tuple, list)) or len(sample) < 2:
        raise UserError(f"data factory '{cfg.name}': samples must be (input, label) pairs, got {type(sample).__name__}")
    return DataSplit(train, val, tuple(torch.as_tensor(sample[0]).shape), _num_classes(train, val))


def _num_classes(*datasets: Dataset) -> int | None:
    """From a `num_classes` or `classes` attribute, else from integer labels held in memory."""
    labels = []
    for dataset in datasets:
        base = getattr(dataset, "dataset", dataset)  # through a Subset
        if hasattr(base, "num_classes"):
            return int(base.num_classes)
        if hasattr(base, "classes"):
            return len(base.classes)
        held = base.tensors[1] if isinstance(base, TensorDataset) and len(base.tensors) > 1 else getattr(base, "targets", None)
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
    return DataSplit(
        TensorDataset(x[train_idx], y[train_idx]),
        TensorDataset(x[val_idx], y[val_idx]),
        tuple(x.shape[1:]),
        int(y.max()) + 1,
    )


def _standardized(split: DataSplit) -> DataSplit:
    """Zero mean, unit variance per input feature, with statistics from the training part only."""
    train_x, train_y = split.train.tensors  # type: ignore[attr-defined]
    val_x, val_y = split.val.tensors  # type: ignore[attr-defined]
    mean = train_x.mean(dim=0)
    std = train_x.std(dim=0).clamp_min(0.1)  # border pixels are almost always 0
    split.train = TensorDataset((train_x - mean) / std, train_y)
    split.val = TensorDataset((val_x - mean) / std, val_y)
    return split


def _random_split(dataset: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    n = len(dataset)  # type: ignore[arg-type]
    if n < 2:
        raise UserError(f"the data set has {n} sample(s): at least 2 are needed for train and validation")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    val, train = torch.utils.data.random_split(dataset, [n_val, n - n_val], generator=torch.Generator().manual_seed(seed))
    return train, val

"""Data sets: the built-ins, `.npz` files, memory-mapped `.npy` directories and token files
(hvdtrain.data.mapped) and user factories, split into train and validation.

A user's own `torch.utils.data.Dataset` works unchanged (through a factory), whatever
its samples hold (see hvdtrain.data.batch); data held in tensors takes a faster path
(hvdtrain.data.loading) that gathers a whole batch with one index operation.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, TensorDataset

from hvdtrain.config import DataConfig
from hvdtrain.data.batch import split_batch
from hvdtrain.data import huggingface, introspect, mapped, shards
from hvdtrain.data.mapped import HeldOut
from hvdtrain.data.streams import IterableSource, StreamDataset, iterable_length, iterable_parts
from hvdtrain.errors import UserError
from hvdtrain.factory import call_factory, is_factory_path

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
    if cfg.name not in BUILT_IN and huggingface.is_hugging_face(cfg.name):
        return _hugging_face(cfg)
    if cfg.name not in BUILT_IN and shards.is_shards(cfg.name):
        return _streamed_shards(cfg, seed)
    if cfg.name not in BUILT_IN and mapped.is_array_directory(cfg.name):
        return _mapped_arrays(*mapped.array_parts(Path(cfg.name), cfg.val_fraction))
    if mapped.is_token_file(cfg.name):
        train, val = mapped.token_parts(Path(cfg.name), cfg.token_dtype, cfg.context, cfg.val_fraction)
        return DataSplit(train, val, (cfg.context,), cfg.num_classes or mapped.vocabulary(train, val))
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
        parts = list(made) if isinstance(made, tuple) and len(made) == 2 else [made]
        parts = [StreamDataset(IterableSource(part, HeldOut(iterable_length(part, cfg.name)), cfg.name), seed)
                 if isinstance(part, IterableDataset) else part for part in parts]
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)
    if cfg.name not in BUILT_IN and huggingface.is_hugging_face(cfg.name):
        return huggingface.whole(cfg.name, cfg.input_columns, cfg.target_column)
    if cfg.name not in BUILT_IN and shards.is_shards(cfg.name):
        return StreamDataset(shards.whole(cfg.name, cfg.input_columns, cfg.target_column), seed)
    if cfg.name not in BUILT_IN and (mapped.is_array_directory(cfg.name) or mapped.is_token_file(cfg.name)):
        return mapped.whole(Path(cfg.name), cfg.token_dtype, cfg.context)
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
    if "/" in cfg.name or Path(cfg.name).exists():
        found = "is not one of these" if Path(cfg.name).exists() else "does not exist"
        raise UserError(f"data path '{cfg.name}' {found}: give a directory of x.npy and y.npy, an .npz file, "
                        "a .bin token file or .tar shards")
    raise UserError(
        f"unknown data set '{cfg.name}': use one of {', '.join(BUILT_IN)}, a path to an .npz file, a directory "
        "of .npy arrays, a .bin token file, or package.module:function"
    )


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    # The file behind sklearn.datasets.load_digits, read without importing scikit-learn: that import
    # (SciPy with it) costs each rank about 1.5 s of CPU at every start.
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise UserError("the digits data set ships inside scikit-learn: pip install scikit-learn")
    files = [Path(top) / "datasets" / "data" / "digits.csv.gz" for top in spec.submodule_search_locations or []]
    found = next((path for path in files if path.is_file()), None)
    if found is None:  # laid out otherwise (a zipped install): scikit-learn's own reader
        from sklearn.datasets import load_digits

        digits = load_digits()
        table = np.hstack([digits.data, digits.target[:, None]]).astype(np.float32)
    else:  # 1797 rows: 64 pixels in 0..16, then the digit
        table = np.loadtxt(found, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :-1].reshape(-1, 1, 8, 8) / 16.0)  # (N, 1, 8, 8)
    return x, torch.from_numpy(table[:, -1].astype(np.int64))


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
    _require_finite(path, "x", x)
    inputs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if y is None:
        return inputs, None
    if len(x) != len(y):
        raise UserError(f"data file '{path}': x has {len(x)} samples but y has {len(y)}: they must match")
    if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
        raise UserError(f"data file '{path}': y must hold class labels or numbers, got dtype {y.dtype}")
    _require_finite(path, "y", y)
    # Integer labels stay integers (classification); anything else becomes float32 (regression, multilabel).
    targets = y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else np.ascontiguousarray(y, dtype=np.float32)
    return inputs, torch.from_numpy(targets)


def _mapped_arrays(train: mapped.MappedArrays, val: mapped.MappedArrays) -> DataSplit:
    """What the arrays say of themselves, from the files' headers and targets, not their inputs."""
    x, y = train.arrays()
    targets = mapped.target_files(train, val)
    largest = mapped.largest_label(targets)
    target_dtype = np.int64 if largest is not None else np.float32
    held = None
    if sum(t.size for t in targets) * 8 <= HELD_TARGETS_LIMIT:  # for the label checks; large ones are not copied
        held = torch.cat([torch.from_numpy(np.array(t, dtype=target_dtype)) for t in targets])
    return DataSplit(train, val, tuple(x.shape[1:]), None if largest is None else largest + 1, tuple(y.shape[1:]),
                     held, torch.int64 if largest is not None else torch.float32)


HELD_TARGETS_LIMIT = 128 << 20


def _streamed_shards(cfg: DataConfig, seed: int) -> DataSplit:
    train, val = shards.shard_parts(cfg.name, cfg.input_columns, cfg.target_column, cfg.val_fraction)
    held = shards.held_labels(train, val)
    return _streamed(StreamDataset(train, seed), StreamDataset(val, seed), held,
                     None if held is None else int(held.max()) + 1)


def _streamed(train: StreamDataset, val: StreamDataset, held: torch.Tensor | None, classes: int | None,
              target_key: str = "labels") -> DataSplit:
    """What the first sample says of a stream's samples (reading no further)."""
    inputs, target = split_batch(train[0], target_key)
    dtype = torch.as_tensor(target).dtype if introspect.shape_of(target) is not None else None
    return DataSplit(train, val, introspect.shape_of(inputs), classes, introspect.shape_of(target), held, dtype)


def _hugging_face(cfg: DataConfig) -> DataSplit:
    train, val, classes = huggingface.parts(cfg.name, cfg.input_columns, cfg.target_column, cfg.val_fraction)
    inputs, target = split_batch(train[0], "labels")
    held = None
    scalar = target is not None and introspect.shape_of(target) == ()
    tables = list({id(part.table): part.table for part in (train, val)}.values())
    if scalar and sum(len(table) for table in tables) * 8 <= HELD_TARGETS_LIMIT:  # one number per row, for the checks
        columns = [np.asarray(table[train.target]) for table in tables]
        kind = np.int64 if all(np.issubdtype(c.dtype, np.integer) for c in columns) else np.float32
        held = torch.cat([torch.from_numpy(c.astype(kind)) for c in columns])
    dtype = torch.as_tensor(target).dtype if target is not None else None
    if classes is None and held is not None and not held.is_floating_point():
        classes = int(held.max()) + 1
    return DataSplit(train, val, introspect.shape_of(inputs), classes, introspect.shape_of(target), held, dtype)


def _require_finite(path: Path, key: str, values: np.ndarray) -> None:
    """NaN or Inf in a data file would surface much later as a non-finite loss, blamed on the lr."""
    if not np.issubdtype(values.dtype, np.floating) or len(values) == 0:
        return
    bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        raise UserError(f"data file '{path}': {key} holds NaN or Inf in {int(bad.sum())} of {len(values)} samples, "
                        f"the first at index {first}: clean or drop them (np.isfinite) before training")


def _from_factory(cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
    made = call_factory(cfg.name, "data set", {})
    if isinstance(made, IterableDataset) or (isinstance(made, tuple) and any(isinstance(part, IterableDataset)
                                                                               for part in made)):
        return _from_iterable(cfg, made, seed, target_key)
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
    dtype = torch.as_tensor(target).dtype if introspect.shape_of(target) is not None else None
    return DataSplit(train, val, introspect.shape_of(inputs), introspect.num_classes(train, val),
                     introspect.shape_of(target), introspect.held_targets(train, val), dtype)


def _from_iterable(cfg: DataConfig, made: Any, seed: int, target_key: str) -> DataSplit:
    """A factory's IterableDataset (or a pair of them): read as a stream, split by rank and worker here."""
    if isinstance(made, tuple):
        if len(made) != 2 or not all(isinstance(part, IterableDataset) for part in made):
            raise UserError(f"data factory '{cfg.name}' returned {len(made)} data sets, not all IterableDatasets: "
                            "return one IterableDataset, or a (train, val) pair of them")
        train_source, val_source = (IterableSource(part, HeldOut(iterable_length(part, cfg.name)), cfg.name)
                                    for part in made)
    else:
        train_source, val_source = iterable_parts(made, cfg.name, cfg.val_fraction)
    train, val = StreamDataset(train_source, seed), StreamDataset(val_source, seed)
    if len(train) == 0 or len(val) == 0:
        raise UserError(f"data factory '{cfg.name}' gave an empty {'train' if len(train) == 0 else 'val'} set")
    return _streamed(train, val, None, introspect.num_classes(made[0] if isinstance(made, tuple) else made),
                     target_key)


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

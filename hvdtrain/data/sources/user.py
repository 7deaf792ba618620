"""A user's data through a `package.module:function` factory: a torch Dataset, or a (train, val)
pair of them, map-style or IterableDataset. Such a Dataset works unchanged, whatever its samples
hold (see hvdtrain.data.batch); an IterableDataset that says its length is read as a stream
(hvdtrain.data.streams) and split by rank and worker there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, IterableDataset

from hvdtrain.config import DataConfig
from hvdtrain.data import introspect
from hvdtrain.data.mapped import HeldOut
from hvdtrain.data.sources.base import DataSplit, described
from hvdtrain.data.streams import IterableSource, StreamDataset, iterable_length, iterable_parts
from hvdtrain.errors import UserError
from hvdtrain.factory import call_factory, is_factory_path


class UserFactory:
    def claims(self, name: str) -> bool:
        return is_factory_path(name) and not name.endswith(".npz")  # a path with a colon can be a file

    def split(self, cfg: DataConfig, seed: int, target_key: str) -> DataSplit:
        made = _made(cfg)
        if isinstance(made, IterableDataset) or (isinstance(made, tuple) and any(isinstance(part, IterableDataset)
                                                                                   for part in made)):
            return _from_iterable(cfg, made, seed, target_key)
        if _arrays(made):  # (x, y) as Keras takes them would read as a (train, val) pair without targets
            raise UserError(f"data factory '{cfg.name}' returned {_not_a_data_set(made)}; return it, or a (train, "
                            "val) pair of such")
        if isinstance(made, tuple) and len(made) == 2:
            train, val = made
        elif isinstance(made, Dataset):
            train, val = _random_split(made, cfg.val_fraction, seed)
        else:
            raise UserError(f"data factory '{cfg.name}' returned " + (instead_of_data(made) or f"{type(made).__name__}: "
                            "return a torch Dataset or a (train, val) pair of them"))
        for part, name in ((train, "train"), (val, "val")):
            if instead := _not_a_data_set(part):
                raise UserError(f"data factory '{cfg.name}': its {name} set is {instead}")
            if not hasattr(part, "__getitem__") or not hasattr(part, "__len__"):
                raise UserError(f"data factory '{cfg.name}': its {name} set, a {type(part).__name__}, is not a "
                                "Dataset: return a map-style Dataset (__getitem__ and __len__), or an IterableDataset "
                                "with __len__ that yields the whole data set each time it is iterated (every epoch)")
        _require_samples(cfg, train, val)
        return described(train, val, target_key, introspect.num_classes(train, val), introspect.held_targets(train, val))

    def whole(self, cfg: DataConfig, seed: int, need_targets: bool) -> Dataset:
        """A (train, val) pair: train first."""
        made = _made(cfg)
        parts = list(made) if isinstance(made, tuple) and len(made) == 2 else [made]
        parts = [StreamDataset(_whole_stream(part, cfg), seed) if isinstance(part, IterableDataset) else part
                 for part in parts]
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)


def _not_a_data_set(made: Any, verb: str = "return") -> str:
    """What a factory returned instead of a data set, a DataLoader or (x, y) arrays, and what to return
    instead ("" for anything else)."""
    if isinstance(made, DataLoader):
        return (f"a DataLoader: {verb} its data set (loader.dataset): hvdtrain makes the loaders, with "
                "--batch-size per process and a sampler that shards by rank")
    sizes = _arrays(made)
    if sizes:
        return (f"a tuple of {len(made)} arrays of {sizes[0]:,} rows, not a data set: make them one, "
                "torch.utils.data.TensorDataset(*(torch.as_tensor(a) for a in arrays))")
    return ""


def instead_of_data(made: Any, verb: str = "return") -> str:
    """What was given for data, and what to give instead: Hugging Face's load_dataset gives a dict of
    splits, and a train/val/test split is often given whole ("" where nothing better can be said)."""
    if instead := _not_a_data_set(made, verb):
        return instead
    if isinstance(made, Mapping) and len(made) >= 2:
        keys = list(made)
        train = next((key for key in keys if str(key).startswith("train")), keys[0])
        val = next((key for key in keys if str(key).startswith(("val", "dev"))), next(k for k in keys if k != train))
        return (f"a dict of {', '.join(repr(key) for key in keys)}: {verb} a (train, val) pair of its data sets, "
                f"(splits[{train!r}], splits[{val!r}]) say")
    if several_data_sets(made):
        evaluate = ("hvdtrain.evaluate(run_dir, data=test_set)" if verb == "pass" else
                    "`hvdtrain evaluate RUN_DIR --data module:function` (a function returning it)")
        return f"{len(made)} data sets: {verb} a (train, val) pair, and evaluate another set after fit with {evaluate}"
    if isinstance(made, tuple) and len(made) == 2:
        for part, name in zip(made, ("train", "val")):
            if instead := _not_a_data_set(part, verb):
                return f"a pair whose {name} set is {instead}"
    return ""


def several_data_sets(made: Any) -> bool:
    """A train/val/test split given whole: more than two data sets in a plain tuple or list."""
    return isinstance(made, (tuple, list)) and not isinstance(made, Dataset) and len(made) > 2 and \
        all(map(is_data_set, made))


def is_data_set(part: Any) -> bool:
    """A map-style or iterable data set (a Hugging Face one too): not an array (whose rows index it as well)
    nor a sample (a plain tuple, list or dict)."""
    return isinstance(part, (Dataset, IterableDataset)) or (
        hasattr(part, "__getitem__") and hasattr(part, "__len__") and not hasattr(part, "dtype")
        and not isinstance(part, (str, bytes, Mapping, tuple, list)))


def _arrays(made: Any) -> list[int]:
    """The leading sizes of a tuple of arrays or tensors of as many rows each (Keras' (x, y)), else []."""
    if not isinstance(made, tuple) or not made or not all(hasattr(part, "shape") and len(part.shape) >= 1
                                                          for part in made):
        return []
    sizes = [int(part.shape[0]) for part in made]
    shapes = {tuple(part.shape) for part in made}  # train and val tensors alike in shape are a (train, val) pair
    return sizes if len(set(sizes)) == 1 and sizes[0] > len(made) and len(shapes) > 1 else []


def _made(cfg: DataConfig) -> Any:
    """What the user's factory returns: the one place it is called. A list of two data sets is the pair."""
    made = call_factory(cfg.name, "data set", {}, args=cfg.args, args_key="data.args")
    return tuple(made) if isinstance(made, list) and len(made) == 2 and all(map(is_data_set, made)) else made


def _whole_stream(dataset: IterableDataset, cfg: DataConfig) -> IterableSource:
    return IterableSource(dataset, HeldOut(iterable_length(dataset, cfg.name)), cfg.name)


def _require_samples(cfg: DataConfig, train: Dataset, val: Dataset) -> None:
    if len(train) == 0 or len(val) == 0:  # type: ignore[arg-type]
        raise UserError(f"data factory '{cfg.name}' gave an empty {'train' if len(train) == 0 else 'val'} set")  # type: ignore[arg-type]


def _from_iterable(cfg: DataConfig, made: Any, seed: int, target_key: str) -> DataSplit:
    """A factory's IterableDataset (or a pair of them): read as a stream, split by rank and worker here."""
    if isinstance(made, tuple):
        if len(made) != 2 or not all(isinstance(part, IterableDataset) for part in made):
            raise UserError(f"data factory '{cfg.name}' returned {len(made)} data sets, not all IterableDatasets: "
                            "return one IterableDataset, or a (train, val) pair of them")
        train_source, val_source = (_whole_stream(part, cfg) for part in made)
    else:
        train_source, val_source = iterable_parts(made, cfg.name, cfg.val_fraction)
    train, val = StreamDataset(train_source, seed), StreamDataset(val_source, seed)
    _require_samples(cfg, train, val)
    return described(train, val, target_key, introspect.num_classes(made[0] if isinstance(made, tuple) else made), None)


def _random_split(dataset: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    n = len(dataset)  # type: ignore[arg-type]
    if n < 2:
        raise UserError(f"the data set has {n} sample(s): at least 2 are needed for train and validation")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    val, train = torch.utils.data.random_split(dataset, [n_val, n - n_val], generator=torch.Generator().manual_seed(seed))
    return train, val

"""Whether every rank made the same samples as rank 0. Each rank makes its data itself, and where a
factory's result hangs on the process (classes numbered through a set of strings, which Python hashes
otherwise in each process; files listed in a host's own order; a shuffle from a generator of its own
seeded from the clock; a data set the factory sharded by rank) each rank holds other samples in a data
set of the same size. hvdtrain then shards each rank's own: some samples are trained twice and some
never, validation samples are another rank's training ones, a label means another class on each rank,
and nothing says so. Sizes alone cannot tell (`setup.check_same_data`); a few samples of each part can.

They are read with the random generators seeded alike (a random transform draws the same on every
rank) and then put back as they were. A sample that reads otherwise a second time on the same rank
(augmentation from a generator of the data set's own) cannot be compared: the check then passes."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from hvdtrain.errors import UserError

if TYPE_CHECKING:
    from hvdtrain.engine import Engine

PROBES = 5
"""Samples read from each part, spread over it."""
SEED = 20_251_130
"""The random generators' seed as a sample is read (plus its index): the same on every rank."""


def check_same_samples(parts: Mapping[str, Dataset | None], engine: Engine) -> None:
    """Raises UserError on every rank where some rank's samples of a part differ from rank 0's. Collectives,
    the same ones on every rank whatever its samples hold: reading a sample never raises here (its error
    is what it holds)."""
    read = {name: _read(dataset) for name, dataset in parts.items() if _indexable(dataset)}
    digests = engine.allgather_object({name: [_digest(sample) for _, sample in samples]
                                       for name, samples in read.items()}, "same_samples")  # dist
    if all(theirs == digests[0] for theirs in digests):
        return
    # dist: every rank is here. Rank 0's samples, compared on each rank (floats within rounding: another
    # host's CPU may round a factory's arithmetic otherwise), and whether this rank reads its own alike twice.
    rank_0_s = engine.broadcast_object(read if engine.is_root else None, "same_samples.rank_0")
    steady = all(_digest(again) == _digest(sample) for name, samples in read.items()
                 for (_, sample), (_, again) in zip(samples, _read(parts[name])))
    differs = _first_difference(rank_0_s, read) if steady else None
    answers = engine.allgather_object((steady, differs), "same_samples.answers")
    if not all(steady for steady, _ in answers):
        return  # a sample reads otherwise each time: no rank's can be compared
    rank, differs = next(((rank, differs) for rank, (_, differs) in enumerate(answers) if differs), (None, None))
    if differs is None:
        return
    sample, unread_on, error = differs
    if unread_on is not None:  # a file missing or broken on one host: the cause, not other samples
        failed = rank if unread_on == "there" else 0
        raise UserError(f"rank {failed} could not read {sample} (rank {rank if failed == 0 else 0} could): {error}")
    raise UserError(f"rank {rank} made other samples than rank 0: {sample}: every rank must make the same data "
                    "set, in the same order (number classes in sorted order, not a set's; list files sorted; "
                    "seed a shuffle of your own); hvdtrain shards it by rank itself, so do not shard it in your "
                    "factory")


class Unread(str):
    """A sample whose reading raised: the error, in words."""


def _indexable(dataset: Any) -> bool:
    """A map-style data set with samples (a stream's shards are compared instead)."""
    try:
        return dataset is not None and not isinstance(dataset, IterableDataset) and len(dataset) > 0
    except TypeError:  # no len()
        return False


def _read(dataset: Dataset) -> list[tuple[int, Any]]:
    """(index, sample as plain values) for PROBES indices spread over the data set; the random states
    this process had are put back after."""
    size = len(dataset)  # type: ignore[arg-type]
    indices = sorted({round(k * (size - 1) / max(PROBES - 1, 1)) for k in range(PROBES)})
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            samples = []
            for index in indices:
                torch.default_generator.manual_seed(SEED + index)  # not torch.manual_seed: CUDA's stay as they are
                np.random.seed(SEED + index)
                random.seed(SEED + index)
                try:
                    samples.append((index, _plain(dataset[index])))
                except Exception as err:  # noqa: BLE001 - what this rank holds there, compared as any sample
                    samples.append((index, Unread(f"{type(err).__name__}: {err}")))
            return samples
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def _plain(value: Any) -> Any:
    """A sample as numpy arrays, numbers, strings, lists and dicts: what compares and pickles the same anywhere."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        try:
            return (value.float() if value.is_floating_point() and value.dtype != torch.float64 else value).numpy()
        except (TypeError, RuntimeError):  # a sparse or quantized tensor
            return repr(value)
    if isinstance(value, np.ndarray):
        return value if value.dtype != object else [_plain(item) for item in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return value
    if hasattr(value, "__array_interface__"):  # a PIL image
        return np.asarray(value)
    return repr(value)


def _digest(value: Any) -> str:
    hashed = hashlib.sha256()

    def add(item: Any) -> None:
        if isinstance(item, np.ndarray):
            hashed.update(f"{item.dtype.str}{item.shape}".encode())
            hashed.update(np.ascontiguousarray(item).tobytes())
        elif isinstance(item, dict):
            for key in sorted(item):
                hashed.update(repr(key).encode())
                add(item[key])
        elif isinstance(item, list):
            hashed.update(b"[%d" % len(item))
            for each in item:
                add(each)
        else:
            hashed.update(repr(item).encode())

    add(value)
    return hashed.hexdigest()


def _first_difference(rank_0_s: dict[str, list[tuple[int, Any]]], mine: dict[str, list[tuple[int, Any]]]
                      ) -> tuple[str, str | None, str] | None:
    """Where this rank's samples first differ from rank 0's: (the sample and how, in words; "there" or
    "rank 0" where one of the two could not be read, and the error); None where they are alike."""
    for name, samples in mine.items():
        for (index, sample), (_, theirs) in zip(samples, rank_0_s.get(name, [])):
            named = f"sample {index}" if name == "all" else f"{name} sample {index}"  # evaluate's --split all
            for unread, on in ((sample, "there"), (theirs, "rank 0")):
                if isinstance(unread, Unread) and not (isinstance(sample, Unread) and isinstance(theirs, Unread)):
                    return named, on, str(unread)
            where = _where_unlike(theirs, sample, "")
            if where is not None:
                return f"{named} differs{where}", None, ""
    return None


def _where_unlike(root: Any, mine: Any, path: str) -> str | None:
    inside = f" at {path}" if path else ""
    if isinstance(root, np.ndarray) and isinstance(mine, np.ndarray):
        if root.shape != mine.shape or root.dtype.kind != mine.dtype.kind:
            return f"{inside}: {_kind(mine)} there, {_kind(root)} on rank 0"
        if root.dtype.kind in "fc":
            if np.allclose(root, mine, rtol=1e-5, atol=1e-6, equal_nan=True):
                return None
        elif np.array_equal(root, mine):
            return None
        if root.size == 1:
            return f"{inside}: {mine.item()!r} there, {root.item()!r} on rank 0"
        return f"{inside}: {_kind(mine)} unlike rank 0's in {int((root != mine).sum())} of {root.size} values"
    if isinstance(root, dict) and isinstance(mine, dict):
        if sorted(root) != sorted(mine):
            return f"{inside}: keys {sorted(mine)} there, {sorted(root)} on rank 0"
        return next((found for key in root if (found := _where_unlike(root[key], mine[key], f"{path}[{key!r}]"))),
                    None)
    if isinstance(root, list) and isinstance(mine, list) and len(root) == len(mine):
        return next((found for i, (a, b) in enumerate(zip(root, mine))
                     if (found := _where_unlike(a, b, f"{path}[{i}]"))), None)
    if isinstance(root, float) and isinstance(mine, float) and np.isclose(root, mine, rtol=1e-5, atol=1e-6):
        return None
    if type(root) is type(mine) and root == mine:
        return None
    return f"{inside}: {_short(mine)} there, {_short(root)} on rank 0"


def _kind(array: np.ndarray) -> str:
    return f"{array.dtype} of shape {tuple(array.shape)}"


def _short(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return _kind(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

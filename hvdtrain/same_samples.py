"""Whether every rank made the same samples as rank 0. Each rank makes its data itself, and where a
factory's result hangs on the process (classes numbered through a set of strings, which Python hashes
otherwise in each process; files listed in a host's own order; a shuffle from a generator of its own
seeded from the clock; a data set the factory sharded by rank) each rank holds other samples in a data
set of the same size. hvdtrain then shards each rank's own: some samples are trained twice and some
never, validation samples are another rank's training ones, a label means another class on each rank,
and nothing says so. Sizes alone cannot tell (`setup.check_same_data`); a few samples of each part can.

They are read with the random generators seeded alike (a random transform draws the same on every
rank) and then put back as they were. What cannot be held against rank 0's passes: a sample that reads
otherwise a second time on some rank (augmentation from a generator of the data set's own), strings (a
path on the host's own disk), numbers within rounding (another host's CPU or image decoder), a sample no
rank can read (training names it), and streams, whose shards are compared instead."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from hvdtrain.data.streams import StreamDataset
from hvdtrain.errors import UserError

if TYPE_CHECKING:
    from hvdtrain.engine import Engine

PROBES = 5
"""Samples read from each part, spread over it."""
SEED = 20_251_130
"""The random generators' seed as a sample is read (plus its index): the same on every rank."""
ROUNDING = 0.01
"""Numbers alike within this share of the largest one of the sample's array (bf16's own rounding is 0.4%)."""


def check_same_samples(parts: Mapping[str, Dataset | None], engine: Engine) -> None:
    """Raises UserError on every rank where some rank's part differs from rank 0's in size or in a sample.
    Collectives, the same ones on every rank: each decision is taken from what every rank sent, and what
    a rank does alone between them (reading, comparing) never raises."""
    if engine.size == 1:
        return
    try:
        read = {name: _read(dataset) for name, dataset in parts.items() if _comparable(dataset)}
        mine = {name: (len(parts[name]), [_digest(sample) for _, sample in samples])  # type: ignore[arg-type]
                for name, samples in read.items()}
    except Exception:  # noqa: BLE001 - this rank cannot tell: no rank checks, and none is left waiting
        read, mine = {}, None
    everyone = engine.allgather_object(mine, "same_samples")  # dist
    if None in everyone or all(theirs == everyone[0] for theirs in everyone):
        return
    _check_sizes(everyone)
    unlike = [name for name in everyone[0] if any(theirs.get(name) != everyone[0][name] for theirs in everyone)]
    steady = engine.allgather_object(_steady({name: read[name] for name in unlike}, parts), "same_samples.steady")
    for name, position in _suspects(everyone, steady):  # the same on every rank
        index, sample = read[name][position]
        rank_0_s = engine.broadcast_object(sample if engine.is_root else None, "same_samples.rank_0")  # dist: one sample
        answers = engine.allgather_object(None if engine.is_root else _compared(rank_0_s, sample),
                                          "same_samples.answers")
        rank, answer = next(((rank, answer) for rank, answer in enumerate(answers) if answer), (None, None))
        if answer is not None:
            raise _refusal(rank, f"sample {index}" if name == "all" else f"{name} sample {index}", answer)


def _comparable(dataset: Any) -> bool:
    """A map-style data set with samples, and no stream in it (a read by position walks a stream)."""
    try:
        return dataset is not None and not _streamed(dataset) and len(dataset) > 0
    except TypeError:  # no len()
        return False


def _streamed(dataset: Any) -> bool:
    if isinstance(dataset, (StreamDataset, IterableDataset)):
        return True
    inner = [*getattr(dataset, "datasets", ()), *([dataset.dataset] if hasattr(dataset, "dataset") else [])]
    return any(_streamed(each) for each in inner)  # a Subset's, a ConcatDataset's


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
                    samples.append((index, Unread(_said(err))))
            return samples
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


class Unread(str):
    """A sample whose reading raised: the error, in words."""


def _said(err: Exception) -> str:
    try:
        lines = str(err).splitlines()
    except Exception:  # noqa: BLE001 - an exception whose text cannot be made
        lines = []
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


TEXT = "<text>"
"""What a string (or an object's repr) is compared as: any text is alike, so its content neither counts
against a rank nor makes a sample read otherwise (an id, a time, a path on the host's own disk)."""


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
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {_key(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):  # in an order of this process's string hashes
        return sorted((_plain(item) for item in value), key=repr)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):  # its own type: a subclass might not pickle on the way to the others
        return int(value) if abs(value) < 2**63 else TEXT
    if isinstance(value, float):
        return float(value)
    if isinstance(value, bytes):
        return bytes(value)
    if hasattr(value, "__array_interface__"):  # a PIL image
        return np.asarray(value)
    return TEXT  # a string, or an object known by its repr


def _key(key: Any) -> str:
    return repr(key) if isinstance(key, (str, int, float, bool, type(None))) else f"<{type(key).__name__}>"


def _digest(value: Any) -> str:
    hashed = hashlib.sha256()

    def add(item: Any) -> None:
        if isinstance(item, np.ndarray):
            hashed.update(f"{item.dtype.descr}{item.shape}".encode())
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
            hashed.update(f"{type(item).__name__}:{item!r}".encode())

    add(value)
    return hashed.hexdigest()


def _check_sizes(everyone: list[dict[str, tuple[int, list[str]]]]) -> None:
    sizes = [{name: size for name, (size, _) in parts.items()} for parts in everyone]
    if any(theirs != sizes[0] for theirs in sizes):
        listed = ", ".join(f"rank {rank}: " + " / ".join(f"{size} {name}" for name, size in held.items())
                           for rank, held in enumerate(sizes))
        raise UserError(f"ranks made data sets of different sizes ({listed}): every rank must make the same data "
                        "set; hvdtrain shards it by rank itself, so do not shard it in your factory")


def _steady(read: dict[str, list[tuple[int, Any]]], parts: Mapping[str, Any]) -> dict[str, bool]:
    """Per part, whether every sample of it reads alike twice more on this rank. Per part, not per
    sample: an augmentation of few outcomes (a shift of 0 or 1) often draws alike three times by chance
    in one sample, hardly ever in all five on every rank. False where that cannot be told: nothing is
    then compared."""
    try:
        return {name: all(_digest(again) == _digest(sample) for _round in range(2)
                          for (_, sample), (_, again) in zip(samples, _read(parts[name])))
                for name, samples in read.items()}
    except Exception:  # noqa: BLE001 - this rank's answer must reach the others' collective
        return {name: False for name in read}


def _suspects(everyone: list[dict[str, tuple[int, list[str]]]], steady: list[dict[str, bool]]
              ) -> list[tuple[str, int]]:
    """(part, position) of each sample some rank holds otherwise than rank 0, in a part read alike twice on
    every rank."""
    suspects = []
    for name, (_, root) in everyone[0].items():
        if not all(held.get(name, False) for held in steady):
            continue
        for position, digest in enumerate(root):
            if not all(len(parts.get(name, (0, []))[1]) > position and parts[name][1][position] == digest
                       for parts in everyone):
                suspects.append((name, position))
    return suspects


def _compared(rank_0_s: Any, mine: Any) -> tuple[str, str] | None:
    """How this rank's sample differs from rank 0's: ("unread there" or "unread on rank 0", the error), or
    ("differs", where and how); None where they are alike, or cannot be compared."""
    try:
        if isinstance(rank_0_s, Unread) or isinstance(mine, Unread):
            if isinstance(rank_0_s, Unread) and isinstance(mine, Unread):
                return None  # no rank reads it: training meets it and names it
            return ("unread there", str(mine)) if isinstance(mine, Unread) else ("unread on rank 0", str(rank_0_s))
        where = _where_unlike(rank_0_s, mine, "")
        return None if where is None else ("differs", where)
    except Exception:  # noqa: BLE001 - this rank's answer must reach the others' collective
        return None


def _refusal(rank: int, sample: str, answer: tuple[str, str]) -> UserError:
    kind, said = answer
    if kind == "unread there":  # a file missing or broken on one host: the cause, not other samples
        return UserError(f"rank {rank} could not read {sample} (rank 0 could): {said}")
    if kind == "unread on rank 0":
        return UserError(f"rank 0 could not read {sample} (rank {rank} could): {said}")
    return UserError(f"rank {rank} made other samples than rank 0: {sample} differs{said}: every rank must make the "
                     "same data set, in the same order (number classes in sorted order, not a set's; list files "
                     "sorted; seed a shuffle of your own); hvdtrain shards it by rank itself, so do not shard it in "
                     "your factory")


def _where_unlike(root: Any, mine: Any, path: str) -> str | None:
    inside = f" at {path}" if path else ""
    if isinstance(root, (int, float)) and isinstance(mine, (int, float)) and not isinstance(root, bool):
        root, mine = np.asarray(root), np.asarray(mine)
    if isinstance(root, np.ndarray) and isinstance(mine, np.ndarray):
        if root.shape != mine.shape or root.dtype.kind != mine.dtype.kind:
            return f"{inside}: {_kind(mine)} there, {_kind(root)} on rank 0"
        if _alike(root, mine):
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
    if type(root) is type(mine) and root == mine:
        return None
    return f"{inside}: {_short(mine)} there, {_short(root)} on rank 0"


def _alike(root: np.ndarray, mine: np.ndarray) -> bool:
    """Equal; floats and 8-bit pixels (another image decoder) within ROUNDING of the array's largest.
    Other integers (labels, token ids) exactly."""
    if not (root.dtype.kind == "f" or (root.dtype.kind == "u" and root.dtype.itemsize == 1 and root.size > 1)):
        return bool(np.array_equal(root, mine))
    a, b = root.astype(np.float64), mine.astype(np.float64)
    finite = np.abs(np.concatenate([a[np.isfinite(a)], b[np.isfinite(b)]]))
    scale = finite.max() if finite.size else 0.0
    return bool(np.allclose(a, b, rtol=0.0, atol=ROUNDING * scale, equal_nan=True))


def _kind(array: np.ndarray) -> str:
    return f"{array.dtype} of shape {tuple(array.shape)}"


def _short(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return _kind(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

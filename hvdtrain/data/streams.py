"""Data read front to back: tar shards (hvdtrain.data.shards) and a user's IterableDataset that
says its length, behind one map-style Dataset whose index is a position in an epoch's stream.

An epoch's stream is the shards one after another, in an order drawn from (seed, epoch) for
training, from a sample drawn too (wrapping around); in their own order for evaluation. `StreamBatchSampler` gives each rank one
contiguous range of it, so a rank (and each of its data-loader workers) reads its own shards
sequentially; the reads here follow the positions forward, opening a shard once and passing over
what another rank or worker reads. A batch may say which positions of a block its worker will be
asked for (`StreamBatch.blocks`): those are read in file order at once and held, which is the
shuffle buffer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from hvdtrain.data.mapped import HeldOut
from hvdtrain.errors import UserError


class Cursor(Protocol):
    shard: int
    position: int
    """The part's next sample in the shard: reads go forward from here."""

    def read(self, index: int) -> Any: ...

    def close(self) -> None: ...


class Stream(Protocol):
    """What a `StreamDataset` reads: `shards.Shards`, or an `IterableSource` (one shard)."""

    counts: list[int]
    """Samples of the part in each shard."""

    def names(self) -> list[str]: ...

    def open(self, shard: int) -> Cursor: ...

    def decode(self, raw: Any) -> Any: ...


class StreamBatch(list):
    """A batch of stream positions, with the epoch whose order they are in, the seed of the draws
    made while loading it (as `sampler.SeededBatch`), and for each block this batch is the first of
    its worker to touch, every position of the block that worker will be asked for."""

    def __init__(self, positions: list[int], seed: int, epoch: int, blocks: list[np.ndarray]):
        super().__init__(positions)
        self.seed, self.epoch, self.blocks = seed, epoch, blocks


class StreamDataset(Dataset):
    """The samples of a stream by position; in a training epoch's shard order when asked with a
    `StreamBatch`, else in the shards' own order."""

    def __init__(self, source: Stream, seed: int):
        self.source, self.seed = source, seed
        self.counts = np.asarray(source.counts, dtype=np.int64)
        self._orders: dict[int | None, tuple[np.ndarray, np.ndarray, int]] = {}
        self._cursor: Cursor | None = None
        self._held: dict[tuple[int | None, int], Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self.counts.sum())

    def fingerprint(self) -> tuple:
        """What every rank must agree on to map positions to the same samples."""
        return tuple(Path(name).name for name in self.source.names()), tuple(self.counts.tolist())

    def iterates(self) -> bool:
        """Whether reading a range means iterating to it (a user's IterableDataset), not passing over headers."""
        return isinstance(self.source, IterableSource)

    def locate(self, positions: np.ndarray, epoch: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(shard, sample of the part in the shard) of stream positions."""
        if epoch not in self._orders:
            draw = np.random.default_rng([self.seed % 2**64, epoch]) if epoch is not None else None
            order = draw.permutation(len(self.counts)) if draw else np.arange(len(self.counts))
            # The stream begins at a drawn sample, too: what an epoch leaves out at its end differs
            # each epoch even with one shard (an IterableDataset is one).
            offset = int(draw.integers(len(self))) if draw else 0
            self._orders = {epoch: (order, np.concatenate([[0], np.cumsum(self.counts[order])]), offset)}
        order, starts, offset = self._orders[epoch]
        positions = (positions + offset) % len(self)
        slot = np.searchsorted(starts, positions, side="right") - 1
        return order[slot], positions - starts[slot]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, positions: list[int]) -> list[Any]:
        if self._pid != os.getpid():  # a forked data-loader worker: an open shard's file offset is its parent's too
            self._cursor, self._held, self._pid = None, {}, os.getpid()
        epoch = getattr(positions, "epoch", None)
        if next(iter(self._held), (epoch,))[0] != epoch:
            self._held.clear()  # another epoch's: never asked for now
        for block in getattr(positions, "blocks", ()):
            for position, raw in zip(block, self._read(block, epoch)):
                self._held[(epoch, int(position))] = raw
        wanted = [p for p in positions if (epoch, p) not in self._held]
        read = dict(zip(sorted(wanted), self._read(sorted(wanted), epoch)))
        raws = [self._held.pop((epoch, p)) if (epoch, p) in self._held else read[p] for p in positions]
        return [self.source.decode(raw) for raw in raws]

    def _read(self, positions: Any, epoch: int | None) -> list[Any]:
        """Samples at increasing positions, reading forward (a shard is opened again only to go back)."""
        if len(positions) == 0:
            return []
        shards, indexes = self.locate(np.asarray(positions, dtype=np.int64), epoch)
        raws = []
        for shard, index in zip(shards.tolist(), indexes.tolist()):
            cursor = self._cursor
            if cursor is None or cursor.shard != shard or cursor.position > index:
                if cursor is not None:
                    cursor.close()
                cursor = self._cursor = self.source.open(shard)
            raws.append(cursor.read(index))
        return raws

    def __getstate__(self) -> dict[str, Any]:  # to a worker process: it opens the shards itself
        return {**self.__dict__, "_cursor": None, "_held": {}}


class IterableSource:
    """A user's IterableDataset as one shard: every pass yields the same samples in the same order,
    `len()` of them; a part is every sample or one side of a split of every k-th."""

    def __init__(self, dataset: IterableDataset, part: HeldOut, name: str):
        self.dataset, self.part, self.name = dataset, part, name
        self.counts = [len(part)]

    def names(self) -> list[str]:
        return [self.name]

    def open(self, shard: int) -> "_IterationCursor":
        return _IterationCursor(self)

    def decode(self, raw: Any) -> Any:
        return raw


class _IterationCursor:
    def __init__(self, source: IterableSource):
        self.source, self.shard, self.position = source, 0, 0
        self.samples = iter(source.dataset)
        self.next_sample = 0

    def read(self, index: int) -> Any:
        wanted = self.source.part(index)
        while True:
            try:
                sample = next(self.samples)
            except StopIteration:
                raise UserError(
                    f"data factory '{self.source.name}': its IterableDataset ended after {self.next_sample} samples, "
                    f"but its len() says {self.source.part.total}: make __len__ the samples of one pass, and yield "
                    "the whole data set in every process (hvdtrain splits it by rank and worker itself: do not split "
                    "it with get_worker_info or by rank)") from None
            self.next_sample += 1
            if self.next_sample > wanted:
                self.position = index + 1
                return sample

    def close(self) -> None:
        close = getattr(self.samples, "close", None)
        if close is not None:
            close()


def iterable_parts(dataset: IterableDataset, name: str, val_fraction: float) -> tuple[IterableSource, IterableSource]:
    """(train, val) of one IterableDataset: every k-th sample held out."""
    from hvdtrain.data.mapped import split

    train, val = split(iterable_length(dataset, name), val_fraction)
    return IterableSource(dataset, train, name), IterableSource(dataset, val, name)


def iterable_length(dataset: IterableDataset, name: str) -> int:
    try:
        return int(len(dataset))  # type: ignore[arg-type]
    except TypeError:
        raise UserError(f"data factory '{name}' returned an IterableDataset without a length: hvdtrain needs len() "
                        "(the samples of one pass) to give every rank the same number of batches; define __len__, "
                        "or return a map-style Dataset") from None

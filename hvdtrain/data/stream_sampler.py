"""Sharding a stream by rank: each rank one contiguous range of the epoch's stream.

The epoch's stream (hvdtrain.data.streams) is cut into W ranges of N x B samples, N the same for
every rank (a multiple of train.accumulate): rank r reads its range's shards front to back, and
its data-loader workers read the same range (each only its own batches' samples, passing over the
others'). What is left over, fewer than B x W x accumulate samples, is the end of the epoch's
stream, so each epoch leaves out other samples. Within a rank's range, blocks of `buffer` samples
(data.shuffle_buffer) are served in an order drawn from (seed, epoch, block): a shuffle buffer whose
every state follows from the position, so a run resumed inside an epoch serves what it would have.

The ranges depend on the number of processes (unlike `sampler.ShardedBatchSampler`): a run stopped
inside an epoch resumes there on as many processes; the data-loader workers may differ.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from torch.utils.data import Sampler

from hvdtrain.data.sampler import FeistelPermutation, ShardedBatchSampler, batch_seed
from hvdtrain.data.streams import StreamBatch, StreamDataset


class StreamBatchSampler(Sampler[list[int]]):
    """This rank's batches of stream positions for one epoch (call `set_epoch` each epoch)."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, *, seed: int = 0, multiple: int = 1,
                 buffer: int = 1000, workers: int = 0):
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.seed, self.multiple, self.buffer = seed, multiple, buffer
        self.loaders = max(1, workers)  # who reads: the data-loader workers, batch j to worker j mod loaders
        self.global_batch = batch_size * world_size  # dist
        self.per_rank = (n // (self.global_batch * multiple)) * multiple
        self.dropped = n - self.per_rank * self.global_batch
        self.first = rank * self.per_rank * batch_size  # dist: this rank's range of the stream
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Selects the epoch's order; `start` samples of all ranks are already done (whole global batches)."""
        if start % self.global_batch or not 0 <= start <= self.per_rank * self.global_batch:
            raise ValueError(f"start must be a multiple of {self.global_batch} up to the epoch's end, got {start}")
        self.epoch, self.done = epoch, start // self.global_batch
        self.num_batches = self.per_rank - self.done

    def __len__(self) -> int:
        return self.num_batches

    def _block(self, number: int) -> np.ndarray:
        """Stream positions of this rank's block `number`, in the order they are served."""
        low = number * self.buffer
        size = min(self.buffer, self.per_rank * self.batch_size - low)
        key = batch_seed(self.seed, self.epoch, self.first + low)
        return self.first + low + FeistelPermutation(size, key, self.epoch)(np.arange(size, dtype=np.int64))

    def _span(self, batch: int) -> range:
        """The blocks batch `batch` takes samples from."""
        return range(batch * self.batch_size // self.buffer, ((batch + 1) * self.batch_size - 1) // self.buffer + 1)

    def _take(self, block: np.ndarray, number: int, batch: int) -> np.ndarray:
        """Batch `batch`'s positions in block `number`."""
        low = number * self.buffer
        return block[max(batch * self.batch_size - low, 0):max((batch + 1) * self.batch_size - low, 0)]

    def _held(self, block: np.ndarray, number: int, worker: int) -> np.ndarray:
        """Every position of block `number` that `worker` will be asked for, in file order."""
        low, high = number * self.buffer, number * self.buffer + len(block)
        batches = range(max(self.done, low // self.batch_size), min(self.per_rank, -(-high // self.batch_size)))
        mine = [self._take(block, number, b) for b in batches if (b - self.done) % self.loaders == worker]
        return np.sort(np.concatenate(mine)) if mine else np.empty(0, dtype=np.int64)

    def __iter__(self) -> Iterator[list[int]]:
        blocks: dict[int, np.ndarray] = {}
        hinted = [-1] * self.loaders
        for batch in range(self.done, self.per_rank):
            span = self._span(batch)
            blocks = {number: blocks.get(number) if number in blocks else self._block(number) for number in span}
            worker = (batch - self.done) % self.loaders
            hints = [self._held(blocks[number], number, worker) for number in span if number > hinted[worker]]
            hinted[worker] = span[-1]
            positions = np.concatenate([self._take(blocks[number], number, batch) for number in span])
            seed = batch_seed(self.seed, self.epoch, self.first + batch * self.batch_size)
            yield StreamBatch(positions.tolist(), seed, self.epoch, hints)

    def next_position(self, done: int) -> int:
        """The first stream position of this rank's block after `done` of its batches (a checkpoint's note)."""
        return self.first + (done * self.batch_size // self.buffer) * self.buffer


def training_sampler(dataset: object, batch_size: int, rank: int, world_size: int, *, seed: int, multiple: int,
                     buffer: int, workers: int) -> ShardedBatchSampler | StreamBatchSampler:
    """Rank `rank`'s batches of a training set: a slice of every global batch, or for a stream (tar
    shards, an IterableDataset) a range of the epoch's stream that it reads front to back."""
    if isinstance(dataset, StreamDataset):
        return StreamBatchSampler(len(dataset), batch_size, rank, world_size, seed=seed, multiple=multiple,
                                  buffer=buffer, workers=workers)
    return ShardedBatchSampler(len(dataset), batch_size, rank, world_size, seed=seed,  # type: ignore[arg-type]
                               multiple=multiple)

"""Sharding a data set by rank without materialising the shuffled order.

Training order is a seeded pseudo-random permutation of [0, n) computed on the fly
by a small Feistel network with cycle walking: memory is O(batch), the first batch
is ready in microseconds at any n, and each (seed, epoch) gives a different order.

Global batch t is positions [t*G, (t+1)*G) of the permutation, with G = batch x world
size; rank r takes the r-th slice of B. So the global batches are the same for any
world size with the same G, the shards are disjoint, and together they cover every
sample of the epoch except the final n mod G (each epoch drops different ones).
Unlike `torch.utils.data.DistributedSampler`, nothing is padded or repeated, and all
ranks always see the same number of batches, so no rank waits on another forever.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from torch.utils.data import Sampler

_ROUNDS = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class FeistelPermutation:
    """A bijection of [0, n) keyed by (seed, epoch), evaluated element-wise on arrays."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        bits += bits % 2  # two equal halves
        self._half_bits = np.uint64(bits // 2)
        self._half_mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(_splitmix64((seed << 32) ^ (epoch << 8) ^ round_)) for round_ in range(_ROUNDS)]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        values = positions.astype(np.uint64)
        pending = np.ones(values.shape, dtype=bool)
        # Cycle walking: the network permutes [0, 2^bits); re-apply it until the value
        # lands in [0, n). The domain is under 4n, so this ends after a few passes.
        while pending.any():
            values[pending] = self._encrypt(values[pending])
            pending = values >= np.uint64(self.n)
        return values.astype(np.int64)

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left = values >> self._half_bits
        right = values & self._half_mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._half_mask)
        return (left << self._half_bits) | right


def _splitmix64(x: int) -> int:
    """One step of splitmix64 on a Python int: distinct (seed, epoch, round) give unrelated keys."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: every input bit reaches every output bit.
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9) & _MASK64
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB) & _MASK64
    return x ^ (x >> np.uint64(31))


class SeededBatch(list):
    """A batch of indices and the seed for the random draws made while loading it (augmentation).

    A data-loader worker seeds torch, numpy and Python's `random` with it before it loads the batch
    (`loading.batches`): a worker's random state is then a function of the batch, not of which
    worker got it or how long that worker has lived, so a run resumed in the middle of an epoch
    draws what it would have drawn, and persistent workers still draw anew each epoch.
    """

    def __init__(self, indices: list[int], seed: int):
        super().__init__(indices)
        self.seed = seed


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the batch starting at global `position` of epoch `epoch`'s order (epoch 0 for
    evaluation): the same for that batch whatever the world size, different for any other."""
    return _splitmix64(_splitmix64((seed << 24) ^ epoch) ^ position)


class TrainingSampler(Sampler[list[int]]):
    """What training asks of the sampler of its batches, map-style (`ShardedBatchSampler`) or a stream
    (`stream_sampler.StreamBatchSampler`) alike, so that the loop never asks which it has. `len()` is
    this rank's batches left in the epoch under way (the same on every rank)."""

    global_batch: int
    """dist: samples of all ranks in one batch."""
    epoch: int
    dropped: int
    """Samples of the epoch's order that no rank trains on."""

    def begin_epoch(self, epoch: int, start: int = 0, plan: dict | None = None,
                    writer_size: int | None = None) -> None:
        """Selects the epoch's order, `start` global positions of it already done. Going on inside an
        epoch (a resume, elastic training's last commit): `plan` is what `state_at` gave then, if
        anything, and `writer_size` the number of processes then."""
        raise NotImplementedError

    def state_at(self, position: int) -> dict | None:
        """What a checkpoint taken `position` samples into the epoch keeps for `begin_epoch`'s `plan`;
        None when the position alone says where the epoch stands."""
        raise NotImplementedError

    def dropped_note(self) -> str | None:
        """What a run says of `dropped` as it starts; None where the README says it."""
        return None


class ShardedBatchSampler(TrainingSampler):
    """Yields this rank's batches of indices for one epoch (call `set_epoch` each epoch).

    `multiple` rounds the number of batches down to a multiple (gradient
    accumulation needs whole optimizer steps on every rank). `set_epoch(epoch, start)`
    begins at a global position of the epoch's order: after a world-size change the
    new ranks share what remains, so no sample is seen twice or skipped.
    """

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, *,
                 seed: int = 0, shuffle: bool = True, multiple: int = 1):
        self.n, self.batch_size = n, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch = batch_size * world_size  # dist
        self.multiple = multiple
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Selects the epoch's order; `start` global positions of it are already done."""
        if not 0 <= start <= self.n:
            raise ValueError(f"start must be in [0, {self.n}], got {start}")
        self.epoch, self.start = epoch, start
        self.num_batches = ((self.n - start) // (self.global_batch * self.multiple)) * self.multiple

    def begin_epoch(self, epoch: int, start: int = 0, plan: dict | None = None,
                    writer_size: int | None = None) -> None:
        # dist: a global batch's positions are the same for any number of processes: no plan to keep.
        self.set_epoch(epoch, start)

    def state_at(self, position: int) -> dict | None:
        return None

    @property
    def dropped(self) -> int:  # type: ignore[override]
        return self.n - self.start - self.num_batches * self.global_batch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        permutation = FeistelPermutation(self.n, self.seed, self.epoch) if self.shuffle else None
        offsets = np.arange(self.batch_size, dtype=np.int64)
        for step in range(self.num_batches):
            # dist: this rank's slice of global batch `step`.
            positions = self.start + step * self.global_batch + self.rank * self.batch_size + offsets
            indices = permutation(positions) if permutation is not None else positions
            yield SeededBatch(indices.tolist(), batch_seed(self.seed, self.epoch, int(positions[0])))


class EvalShardSampler(Sampler[list[int]]):
    """Every sample exactly once across ranks: rank r takes the r-th contiguous block."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int):
        # dist: blocks differ by at most one sample; metrics are reduced as sums, so exact.
        self.start = n * rank // world_size
        self.stop = n * (rank + 1) // world_size
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-(self.stop - self.start) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(self.start, self.stop, self.batch_size):
            yield SeededBatch(list(range(first, min(first + self.batch_size, self.stop))), batch_seed(0, 0, first))


class FixedBatchesByRank(Sampler[list[int]]):
    """Batches [b x B, (b + 1) x B) in input order; rank r takes batches r, r + W, r + 2W, ...

    The batches are the same whatever the world size, so a model's outputs per sample are
    bitwise the same with 1 or N processes (a batch's size can change a kernel's rounding,
    and padding depends on the batch's longest sample), and each sample is seen once.
    """

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int):
        self.n, self.batch_size = n, batch_size
        # dist: this rank's batches, round robin.
        self.batch_numbers = range(rank, -(-n // batch_size), world_size)

    def __len__(self) -> int:
        return len(self.batch_numbers)

    def __iter__(self) -> Iterator[list[int]]:
        for number in self.batch_numbers:
            first = number * self.batch_size
            yield list(range(first, min(first + self.batch_size, self.n)))

"""Sharding a stream by rank: each rank one contiguous range of the epoch's stream.

The epoch's stream (hvdtrain.data.streams) is cut into W ranges of N x B samples, N the same for
every rank (a multiple of train.accumulate): rank r reads its range's shards front to back, and
its data-loader workers read the same range (each only its own batches' samples, passing over the
others'). What is left over, fewer than B x W x accumulate samples, is the end of the epoch's
stream, so each epoch leaves out other samples. Within a rank's range, blocks of `buffer` samples
(data.shuffle_buffer) are served in an order drawn from (seed, epoch, block): a shuffle buffer whose
every state follows from the position, so a run resumed inside an epoch serves what it would have.

The ranges depend on the number of processes (unlike `sampler.ShardedBatchSampler`): when it changes
inside an epoch (a resume on another number, elastic training), or the batch size, train.accumulate or
data.shuffle_buffer does, the rest of the epoch is a `Plan` of the positions no rank has served yet,
cut into ranges for the processes there are now. With none of them changed, a resume serves exactly
what the run would have; the data-loader workers may differ.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from hvdtrain.data.sampler import FeistelPermutation, ShardedBatchSampler, TrainingSampler, batch_seed
from hvdtrain.data.streams import StreamBatch, StreamDataset
from hvdtrain.errors import UserError


class Plan:
    """The stream positions an epoch serves, in order, as runs (start, length): all of [0, n) at
    an epoch's start; after a change inside the epoch (`StreamBatchSampler.resume_plan`), those that
    no rank has served yet (still in the stream's order, so still read front to back)."""

    def __init__(self, starts: np.ndarray, lengths: np.ndarray):
        keep = lengths > 0
        self.starts, self.lengths = starts[keep].astype(np.int64), lengths[keep].astype(np.int64)
        self.ends = np.cumsum(self.lengths)

    @classmethod
    def whole(cls, n: int) -> "Plan":
        return cls(np.zeros(1, dtype=np.int64), np.asarray([n], dtype=np.int64))

    @classmethod
    def of_positions(cls, positions: np.ndarray) -> "Plan":
        """Sorted distinct positions, as runs."""
        if len(positions) == 0:
            return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        breaks = np.flatnonzero(np.diff(positions) != 1) + 1
        firsts = np.concatenate([[0], breaks])
        return cls(positions[firsts], np.diff(np.concatenate([firsts, [len(positions)]])))

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The stream positions of plan indices."""
        run = np.searchsorted(self.ends, indices, side="right")
        return self.starts[run] + indices - (self.ends[run] - self.lengths[run])

    def part(self, low: int, high: int) -> "Plan":
        """Plan indices [low, high) as a plan of their own."""
        if high <= low:
            return Plan.of_positions(np.zeros(0, dtype=np.int64))
        first, last = np.searchsorted(self.ends, [low, high - 1], side="right")
        starts, lengths = self.starts[first:last + 1].copy(), self.lengths[first:last + 1].copy()
        before = low - (self.ends[first] - self.lengths[first])
        starts[0] += before
        lengths[0] -= before
        lengths[-1] -= self.ends[last] - high
        return Plan(starts, lengths)

    @staticmethod
    def joined(plans: list["Plan"]) -> "Plan":
        return Plan(np.concatenate([p.starts for p in plans]), np.concatenate([p.lengths for p in plans]))

    def state(self) -> list[list[int]]:
        return np.stack([self.starts, self.lengths], axis=1).tolist()

    @classmethod
    def from_state(cls, runs: list[list[int]]) -> "Plan":
        array = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
        return cls(array[:, 0], array[:, 1])


class StreamBatchSampler(TrainingSampler):
    """This rank's batches of stream positions for one epoch (call `set_epoch` each epoch)."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, *, seed: int = 0, multiple: int = 1,
                 buffer: int = 1000, workers: int = 0):
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.seed, self.multiple, self.buffer = seed, multiple, buffer
        self.loaders = max(1, workers)  # who reads: the data-loader workers, batch j to worker j mod loaders
        self.global_batch = batch_size * world_size  # dist
        self.plan_epoch, self.base = None, 0
        self._use(Plan.whole(n))
        self.set_epoch(0)

    def _use(self, plan: Plan) -> None:
        self.plan = plan
        self.per_rank = (len(plan) // (self.global_batch * self.multiple)) * self.multiple
        self.dropped = len(plan) - self.per_rank * self.global_batch
        self.first = self.rank * self.per_rank * self.batch_size  # dist: this rank's range of the plan

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Selects the epoch's order; `start` samples of all ranks are already done in it (whole global
        batches; of an epoch `resume_plan` set, the samples done before its plan count too)."""
        if epoch != self.plan_epoch:
            self.plan_epoch, self.base = epoch, 0
            self._use(Plan.whole(self.n))
        done = start - self.base
        if done % self.global_batch or not 0 <= done <= self.per_rank * self.global_batch:
            raise ValueError(f"start must be {self.base} plus a multiple of {self.global_batch} up to the epoch's "
                             f"end, got {start}")
        self.epoch, self.done = epoch, done // self.global_batch
        self.num_batches = self.per_rank - self.done

    def begin_epoch(self, epoch: int, start: int = 0, plan: dict | None = None,
                    writer_size: int | None = None) -> None:
        if start:  # dist: the epoch under way, maybe on another number of processes
            self.resume_plan(epoch, plan or {"world_size": self.world_size if writer_size is None else writer_size,
                                             "base": 0, "runs": None, "start": start})
        self.set_epoch(epoch, start)  # dist: a new shuffle, the same on every rank

    def dropped_note(self) -> str | None:
        """A stream's ranges are whole batches; a map-style set's drop is said in the README."""
        if not self.dropped:
            return None
        return (f"streamed data: each rank reads its own range of each epoch's stream; the last {self.dropped:,} "
                f"of its {self.n:,} samples are left out (the end of the epoch's stream: others each epoch)")

    def state_at(self, start: int) -> dict:
        """What a checkpoint taken `start` samples into the epoch keeps, to go on with any number of
        processes, batch size, train.accumulate or data.shuffle_buffer."""
        whole = len(self.plan.starts) == 1 and self.plan.starts[0] == 0 and len(self.plan) == self.n
        return {"world_size": self.world_size, "batch_size": self.batch_size, "multiple": self.multiple,
                "buffer": self.buffer, "seed": self.seed, "samples": self.n, "base": self.base,
                "runs": None if whole else self.plan.state(), "start": start}

    def resume_plan(self, epoch: int, state: dict) -> None:
        """Goes on with an epoch that `state` (`state_at`) was taken in: with its plan where the ranges
        and blocks are the same, else with a plan of what no rank had served."""
        if int(state.get("samples", self.n)) != self.n:
            raise UserError(f"the checkpoint stopped inside epoch {epoch} of a stream of {state['samples']:,} training "
                            f"samples, and the data now has {self.n:,}: resume with the shards it was written with, or "
                            "start a new run (--overwrite or another --run-dir)")
        plan = Plan.whole(self.n) if state.get("runs") is None else Plan.from_state(state["runs"])
        self.plan_epoch, self.base = epoch, int(state.get("base", 0))
        before = StreamBatchSampler(self.n, int(state.get("batch_size", self.batch_size)), 0,
                                    int(state["world_size"]), seed=int(state.get("seed", self.seed)),
                                    multiple=int(state.get("multiple", self.multiple)),
                                    buffer=int(state.get("buffer", self.buffer)))
        if (before.world_size, before.batch_size, before.multiple, before.buffer, before.seed) == \
                (self.world_size, self.batch_size, self.multiple, self.buffer, self.seed):
            self._use(plan)
            return
        before.plan_epoch, before.base, before.epoch = epoch, self.base, epoch
        before._use(plan)
        self._use(before.unserved((int(state["start"]) - self.base) // before.global_batch))
        self.base = int(state["start"])

    def unserved(self, done: int) -> Plan:
        """The plan's positions that no rank has served after `done` batches each."""
        left, length = [], self.per_rank * self.batch_size
        for rank in range(self.world_size):
            first, served = rank * length, done * self.batch_size
            if served >= length:  # its whole range
                continue
            number, into = divmod(served, self.buffer)
            if into:  # the block under way: what its order had not reached
                left.append(Plan.of_positions(np.sort(self._block(number, first)[into:])))
                number += 1
            left.append(self.plan.part(first + min(number * self.buffer, length), first + length))
        left.append(self.plan.part(self.world_size * length, len(self.plan)))  # what the plan left out
        return Plan.joined(left)

    def __len__(self) -> int:
        return self.num_batches

    def _block(self, number: int, first: int | None = None) -> np.ndarray:
        """Stream positions of block `number` of this rank's range (of the range at plan index `first`),
        in the order they are served."""
        first = self.first if first is None else first
        low = number * self.buffer
        size = min(self.buffer, self.per_rank * self.batch_size - low)
        key = batch_seed(self.seed, self.epoch, first + low)
        return self.plan(first + low + FeistelPermutation(size, key, self.epoch)(np.arange(size, dtype=np.int64)))

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


def training_sampler(dataset: object, batch_size: int, rank: int, world_size: int, *, seed: int, multiple: int,
                     buffer: int, workers: int) -> TrainingSampler:
    """Rank `rank`'s batches of a training set: a slice of every global batch, or for a stream (tar
    shards, an IterableDataset) a range of the epoch's stream that it reads front to back."""
    if isinstance(dataset, StreamDataset):
        return StreamBatchSampler(len(dataset), batch_size, rank, world_size, seed=seed, multiple=multiple,
                                  buffer=buffer, workers=workers)
    return ShardedBatchSampler(len(dataset), batch_size, rank, world_size, seed=seed,  # type: ignore[arg-type]
                               multiple=multiple)

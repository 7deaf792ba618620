"""Which rank is slow, and why. Each rank's epoch of training splits into waiting for data, computing its
steps, waiting in collectives, and the rest (logging, callbacks, checkpoint writes: work that rank 0 may
do alone); its engine's clock keeps them (a few attribute writes per step), and the four numbers of every
rank are gathered at the epoch's end in one small allreduce.

Ranks of one job step together, so every rank's wall time per step is the same: a slow rank shows as
the one whose time *outside* collectives (data + compute) is high while the others wait in them. A rank
is named when that time is more than `train.straggler_factor` times the median of the other ranks' and
the difference is a visible part of the epoch (a tenth, and a second at least).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from hvdtrain.engine import Engine

_VISIBLE, _VISIBLE_SECONDS = 0.1, 1.0
"""The least part of the epoch's time, and the fewest seconds, a straggler's extra time must be: less is
noise (a busy core, the first steps' warm-up) and not worth a line. A host with more processes than
cores can hold one rank back half a second in an epoch of one, once: not a straggler."""


@dataclass(frozen=True)
class RankTimes:
    """Seconds of one epoch's training, one entry per rank."""

    data: list[float]
    compute: list[float]
    collectives: list[float]
    other: list[float]

    def record(self) -> dict[str, list[float]]:
        """As metrics.jsonl keeps them."""
        return {"rank_data_s": _rounded(self.data), "rank_compute_s": _rounded(self.compute),
                "rank_collective_s": _rounded(self.collectives), "rank_other_s": _rounded(self.other)}


def gather_times(engine: Engine, began: tuple[float, float, float, float]) -> RankTimes | None:
    """dist: every rank, at the same point: every rank's times since its clock read `began`
    (`engine.phase_seconds()`); None on one process."""
    if engine.size == 1:
        return None
    now = engine.phase_seconds()
    table = torch.zeros(engine.size, 4, dtype=torch.float64)
    table[engine.rank] = torch.tensor([now[i] - began[i] for i in range(4)], dtype=torch.float64)
    rows = engine.allreduce_sum(table.reshape(-1), "rank_times").reshape(engine.size, 4).tolist()  # dist
    return RankTimes([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                     [max(0.0, r[3] - r[0] - r[1] - r[2]) for r in rows])


def stragglers(times: RankTimes, factor: float) -> str | None:
    """`rank 3: 2.4x the others' median step, 70% waiting for data: raise data.num_workers` for each
    slow rank, or None when no rank is (or the check is off: factor 0)."""
    size = len(times.data)
    if factor <= 0 or size < 2:
        return None
    busy = [d + c for d, c in zip(times.data, times.compute)]
    epoch = max(b + w + o for b, w, o in zip(busy, times.collectives, times.other))
    named = []
    for rank in range(size):
        others = [value for other, value in enumerate(busy) if other != rank]
        typical = statistics.median(others)
        if busy[rank] <= factor * typical or busy[rank] - typical < max(_VISIBLE * epoch, _VISIBLE_SECONDS):
            continue
        extra_data = times.data[rank] - statistics.median(d for o, d in enumerate(times.data) if o != rank)
        extra_compute = times.compute[rank] - statistics.median(c for o, c in enumerate(times.compute) if o != rank)
        ratio = f"{busy[rank] / typical:.1f}x" if typical > 0 else "all of"
        if extra_data >= extra_compute:
            named.append(f"rank {rank}: {ratio} the others' median step, {times.data[rank] / busy[rank]:.0%} waiting "
                         "for data: raise data.num_workers, or make its reads faster")
        else:
            named.append(f"rank {rank}: {ratio} the others' median step, {times.compute[rank] / busy[rank]:.0%} "
                         "computing: a slower or busier device or host (other jobs, fewer cores, throttling)")
    return "; ".join(named) or None


def _rounded(values: list[float]) -> list[float]:
    return [round(value, 4) for value in values]

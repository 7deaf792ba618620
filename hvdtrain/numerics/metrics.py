"""Metrics as named sums and counts, so that sharded validation is exact.

A task reports each batch's metrics as `{name: (sum, count)}`; sums and counts may be
tensors of any shape (R² keeps one per output). They are added up on the device over
the batches, then summed over ranks in one allreduce. The value of a metric is its
total sum over its total count, never a mean of per-rank means; a task turns totals
into other values (R², perplexity) in its `summarize`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch

from hvdtrain.errors import UserError

if TYPE_CHECKING:
    from hvdtrain.engine.base import Engine

Totals = dict[str, tuple[torch.Tensor, torch.Tensor]]


class MetricSums:
    """Running (sum, count) per metric name, on one device, in float64."""

    def __init__(self, device: torch.device, template: Mapping[str, tuple[torch.Size, torch.Size]]):
        """`template`: each metric's (sum shape, count shape), the same on every rank, so that
        a rank without a batch still takes part in the reduction with zeros."""
        self.device = device
        self.sums: Totals = {name: (torch.zeros(total, dtype=torch.float64, device=device),
                                    torch.zeros(count, dtype=torch.float64, device=device))
                             for name, (total, count) in template.items()}

    def add(self, metrics: Mapping[str, tuple[Any, Any]]) -> None:
        for name, (total, count) in metrics.items():
            if name not in self.sums:
                raise UserError(f"the task's metrics gave '{name}' on a later batch but not on the first: "
                                "return the same metric names for every batch")
            held_total, held_count = self.sums[name]
            self.sums[name] = (held_total + torch.as_tensor(total, device=self.device).detach(),
                               held_count + torch.as_tensor(count, device=self.device).detach())

    def reduce(self, engine: Engine, name: str) -> Totals:
        """The totals over every rank (one allreduce of all of them, flattened together)."""
        names = sorted(self.sums)  # the same order on every rank
        parts = [t for n in names for t in self.sums[n]]
        if not parts:
            return {}
        flat = torch.cat([p.reshape(-1) for p in parts]).cpu()
        flat = engine.allreduce_sum(flat, name)  # dist: sums, so every sample counts once
        totals: Totals = {}
        offset = 0
        for n in names:
            pieces = []
            for part in self.sums[n]:
                pieces.append(flat[offset:offset + part.numel()].reshape(part.shape))
                offset += part.numel()
            totals[n] = (pieces[0], pieces[1])
        return totals


def ratios(totals: Totals) -> dict[str, float]:
    """Each metric's total sum over its total count (element-wise, then averaged);
    names starting with `_` are intermediate sums, not reported."""
    values = {}
    for name, (total, count) in totals.items():
        if name.startswith("_"):
            continue
        value = total / count.clamp_min(1e-300) if bool((count > 0).all()) else torch.full_like(total, math.nan)
        values[name] = float(value.mean())
    return values


def is_sum_and_count(value: Any) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(v, (torch.Tensor, int, float)) for v in value))

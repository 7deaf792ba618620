"""Allreduce time and bandwidth by message size, for the engine in use.

Bandwidths as nccl-tests define them: algorithm bandwidth = bytes / time; bus
bandwidth = algorithm bandwidth x 2(n-1)/n, comparable across world sizes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hvdtrain.engine import Engine


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


def run(engine: Engine, min_bytes: int = 4 << 10, max_bytes: int = 256 << 20, iterations: int = 5,
        warmup: int = 2, budget_s: float = 5.0) -> list[dict[str, Any]]:
    """One row per size. Large sizes use fewer iterations to stay within `budget_s` each."""
    rows = []
    factor = 2 * (engine.size - 1) / engine.size if engine.size > 1 else 0.0
    for nbytes in sizes(min_bytes, max_bytes):
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=engine.device)
        name = f"bench.allreduce.{nbytes}"
        for _ in range(warmup):
            engine.allreduce_sum(tensor, name)
        engine.barrier()
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            engine.allreduce_sum(tensor, name)
            times.append(time.perf_counter() - start)
            if sum(times) > budget_s:
                break
        # dist: the slowest rank decides when a collective is done.
        seconds = float(engine.allreduce_sum(torch.tensor(sorted(times)[len(times) // 2]), f"{name}.t") / engine.size)
        algbw = nbytes / seconds / 1e9
        rows.append({"bytes": nbytes, "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor})
    return rows


def table(rows: list[dict[str, Any]], engine: Engine) -> str:
    lines = [f"allreduce (sum, fp32), {engine.size} processes, controller {engine.controller}, device {engine.device}",
             f"{'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"]
    lines += [f"{r['bytes']:>12,} {r['time_us']:>12.1f} {r['algbw_GBps']:>13.3f} {r['busbw_GBps']:>13.3f}" for r in rows]
    return "\n".join(lines)

"""Time to the first index and extra peak memory: our sampler against torch's DistributedSampler.

Each measurement runs in a fresh Python process, so peak memory is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_PROBE = """
import json, resource, sys, time
kind, size, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import numpy, torch  # imported before the baseline: not part of the sampler's cost
from torch.utils.data import DistributedSampler
from hvdtrain.data.sampler import ShardedBatchSampler

class Sized:
    def __len__(self):
        return size

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if kind == "hvdtrain":
    first = next(iter(ShardedBatchSampler(size, 1, world - 1, world, seed=0)))[0]
else:
    first = next(iter(DistributedSampler(Sized(), num_replicas=world, rank=world - 1, shuffle=True, seed=0)))
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"sampler": kind, "first_index_ms": seconds * 1e3, "extra_peak_MB": (after - before) / 1024}))
"""

SAMPLERS = {"hvdtrain": "hvdtrain.data.sampler.ShardedBatchSampler", "torch": "torch.utils.data.DistributedSampler"}


def measure(kind: str, size: int, world_size: int, timeout: float = 600) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _PROBE, kind, str(size), str(world_size)],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return {"sampler": kind, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout)


def table(rows: list[dict[str, Any]], size: int, world_size: int) -> str:
    lines = [f"sampler: {size:,} samples, world size {world_size}, rank {world_size - 1}",
             f"{'sampler':<42} {'first index (ms)':>17} {'extra peak (MB)':>16}"]
    for row in rows:
        name = SAMPLERS[row["sampler"]]
        if "error" in row:
            lines.append(f"{name:<42} failed: {row['error']}")
        else:
            lines.append(f"{name:<42} {row['first_index_ms']:>17.2f} {row['extra_peak_MB']:>16.1f}")
    return "\n".join(lines)

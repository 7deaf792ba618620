"""PowerSGD's own arithmetic per step (hvdtrain/engine/powersgd.py), beside the model's forward and backward,
for the two-hosts job's model (benchmarks/two_hosts.py: 17 M parameters, batch 32, rank 4, the default): on one CPU
thread, as each rank of the two-hosts bench runs, and on a GPU. One process, so the collectives are the
identity: what is timed is the compression alone (error feedback, the two thin products, the
orthonormalisation and the approximation), which is what held the two-hosts bench below its ceiling.

    python benchmarks/powersgd_arithmetic.py --devices cpu,cuda --json powersgd.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.two_hosts import comm_heavy  # noqa: E402
from hvdtrain.engine.powersgd import PowerSGD  # noqa: E402

BATCH, FEATURES, CLASSES, RANK = 32, 64, 10, 4


class OneProcess:
    """The segment collectives of a single process: every sum is the tensor itself."""

    rank, size = 0, 1

    def reduce_scatter(self, flat, name):
        return flat

    all_gather = all_to_all = reduce_scatter

    def wait(self, handle):
        return handle

    def allreduce_sum(self, tensor, name):
        return tensor


def measure(device: torch.device, steps: int) -> dict:
    torch.manual_seed(0)
    model = comm_heavy((FEATURES,), CLASSES).to(device)
    params = list(model.parameters())
    compression = PowerSGD(params, OneProcess(), RANK, seed=0, loss_scale=lambda: 1.0)
    x = torch.randn(BATCH, FEATURES, device=device)
    y = torch.randint(0, CLASSES, (BATCH,), device=device)

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()

    def timed(work) -> float:
        for _ in range(3):
            work()
        sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            work()
        sync(device)
        return (time.perf_counter() - started) / steps * 1e3

    step_ms = timed(backward)
    both_ms = timed(lambda: (backward(), compression.wait()))
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, 1 thread",
            "parameters": sum(p.numel() for p in params), "step_ms": step_ms, "powersgd_ms": both_ms - step_ms}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank of the two-hosts bench
    rows = [measure(torch.device(name), args.steps) for name in args.devices.split(",")
            if name != "cuda" or torch.cuda.is_available()]
    text = json.dumps({"batch": BATCH, "rank": RANK, "rows": rows}, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""What stopping on a signal costs: the per-step stop check, and writing a checkpoint inside an epoch.

    python benchmarks/stop_check.py [--repeats 3] [--epochs 3]      (part of `make bench`)

The linear job of benchmarks/jobs.py (2.1 M parameters, 40 steps per epoch) under both engines, with
the stop check on (hvdtrain's default: one 4-value allreduce after every optimizer step) and off
(`--stop-signals ''`), in alternating order; then with a checkpoint every 10 steps. Each figure is
the median of the repeats; the ratios are to the run without the check. Last, the time to write one
checkpoint of that model and its optimizer (rank 0's share of a checkpoint), per MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import FIT, FIT_TORCH, contenders, measure  # noqa: E402

VARIANTS = {
    "stop check off (--stop-signals '')": ["--stop-signals", ""],
    "stop check on (default)": [],
    "stop check on, checkpoint every 10 steps": ["--checkpoint-every-steps", "10"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "stop_check.json"))
    args = parser.parse_args()
    rates: dict[str, dict[str, list[float]]] = {engine: {v: [] for v in VARIANTS} for engine in (FIT, FIT_TORCH)}
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        runs = contenders("linear", args.epochs, run_dir)
        for repeat in range(args.repeats):
            for engine in rates:
                command, extra = runs[engine]
                for variant, flags in VARIANTS.items():  # alternating: drift on a shared machine hits all alike
                    rate = measure(engine, [*command, *flags], extra, run_dir)
                    rates[engine][variant].append(rate)
                    print(f"  run {repeat + 1}/{args.repeats}  {engine}  {variant}: {rate:,.0f} samples/s", flush=True)
        seconds_per_mb, megabytes = checkpoint_cost(Path(scratch) / "checkpoints")
    medians = {engine: {v: statistics.median(r) for v, r in by.items()} for engine, by in rates.items()}
    print(f"\nlinear job, medians of {args.repeats}, samples/s (ratio to the check off)")
    for engine, by in medians.items():
        base = by["stop check off (--stop-signals '')"]
        print(engine)
        for variant, median in by.items():
            print(f"  {variant:<45} {median:>9,.0f}  {median / base:.3f}")
    print(f"checkpoint of the linear model and its SGD state ({megabytes:.1f} MB): {seconds_per_mb * 1000:.1f} ms per MB "
          "(written, fsynced, hashed, linked)")
    Path(args.out).write_text(json.dumps({"samples_per_s": rates, "medians": medians,
                                          "checkpoint_seconds_per_mb": seconds_per_mb,
                                          "checkpoint_mb": megabytes}, indent=2) + "\n")


def checkpoint_cost(directory: Path, writes: int = 5) -> tuple[float, float]:
    """Seconds per MB to write the linear job's checkpoint (model, momentum) through CheckpointStore."""
    import torch

    from benchmarks.jobs import small_cnn
    from hvdtrain.io.checkpoint import CheckpointStore

    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    optimizer.step()
    store = CheckpointStore(directory, keep_last=2)
    started = time.perf_counter()
    for step in range(1, writes + 1):
        path = store.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 0,
                           "step": step, "position": step * 128}, 0, {})
    seconds = (time.perf_counter() - started) / writes
    megabytes = path.stat().st_size / 1e6
    return seconds / megabytes, megabytes


if __name__ == "__main__":
    main()

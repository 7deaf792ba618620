"""Training from files larger than memory: one full epoch over a memory-mapped `.npy` directory and
over a token file under `horovodrun -np 2`, with samples/s and the most anonymous memory (RssAnon:
the process's own, not the file pages it maps) that any rank held, sampled from /proc.

    python benchmarks/large_data.py [--gigabytes 4] [--sources npy,tokens] [--dir /tmp]

Writes the files first (4 GB each by default) and deletes them after; the figures go to
benchmarks/large_data.json and BENCHMARKS.md states them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.run import environment  # noqa: E402

FEATURES = 256  # float32 per sample: 1 KB
CONTEXT = 1024  # tokens per window


def write_arrays(directory: Path, gigabytes: float) -> Path:
    samples, piece = int(gigabytes * 2**30) // (4 * FEATURES), 1 << 18
    directory.mkdir()
    x = np.lib.format.open_memmap(directory / "x.npy", mode="w+", dtype=np.float32, shape=(samples, FEATURES))
    teacher = np.random.default_rng(0).standard_normal((FEATURES, 10), dtype=np.float32)
    labels = np.empty(samples, dtype=np.int64)
    for start in range(0, samples, piece):
        part = np.random.default_rng(start).standard_normal((min(piece, samples - start), FEATURES), dtype=np.float32)
        x[start:start + len(part)] = part
        labels[start:start + len(part)] = (part @ teacher).argmax(axis=1)
    x.flush()
    del x
    np.save(directory / "y.npy", labels)
    return directory


def write_tokens(path: Path, gigabytes: float) -> Path:
    """Runs of t+1 = 3t + 1 (mod 64) from random starts, uint16."""
    tokens, piece = int(gigabytes * 2**30) // 2, 1 << 26
    with open(path, "wb") as handle:
        for start in range(0, tokens, piece):
            ids = np.random.default_rng(start).integers(0, 64, min(piece, tokens - start), dtype=np.uint16)
            handle.write(ids.tobytes())
    return path


def fit(data: Path, run_dir: Path, args: list[str]) -> dict:
    command = ["horovodrun", "-np", "2", "hvdtrain", "fit", "--data", str(data), "--epochs", "1", "--progress", "off",
               "--no-tensorboard", "--run-dir", str(run_dir), *args]
    process = subprocess.Popen(command, cwd=ROOT, env=environment({}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    peaks: dict[int, int] = {}
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(run_dir, peaks, done), daemon=True)
    watcher.start()
    started = time.perf_counter()
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - started
    done.set()
    watcher.join()
    if process.returncode != 0:
        sys.exit(f"large_data: fit on {data} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {"train_samples": record["train_samples"], "train_samples_per_s": record["train_samples_per_s"],
            "val_samples": record["val_samples"], "wall_s": wall,
            "most_rss_anon_MB_per_rank": sorted(round(kb / 1024) for kb in peaks.values())}


def _watch(run_dir: Path, peaks: dict[int, int], done: threading.Event) -> None:
    """The ranks (Python processes whose command line is a fit in the run directory), RssAnon every 0.2 s."""
    while not done.is_set():
        for process in psutil.process_iter(["cmdline"]):
            try:
                line = process.info["cmdline"] or []
                launcher = any(Path(arg).name == "horovodrun" for arg in line)
                if line and "python" in Path(line[0]).name and not launcher and "fit" in line and str(run_dir) in line:
                    status = Path(f"/proc/{process.pid}/status").read_text()
                    anon = int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:")))
                    peaks[process.pid] = max(peaks.get(process.pid, 0), anon)
            except (psutil.Error, OSError, StopIteration):
                continue
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=4.0)
    parser.add_argument("--sources", default="npy,tokens")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="Where to write the files (needs the space).")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "large_data.json"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for source in args.sources.split(","):
            if source == "npy":
                data = write_arrays(Path(tmp) / "arrays", args.gigabytes)
                extra = ["--model", "mlp", "--batch-size", "256", "--threads", "1"]
            else:
                data = write_tokens(Path(tmp) / "tokens.bin", args.gigabytes)
                extra = ["--task", "language-model", "--model", "benchmarks.jobs:token_bigram", "--set",
                         f"data.context={CONTEXT}", "--set", "data.num_classes=64", "--batch-size", "64",
                         "--optimizer", "adamw", "--lr", "0.01", "--threads", "1"]
            size = sum(p.stat().st_size for p in ([data] if data.is_file() else data.iterdir()))
            result = fit(data, Path(tmp) / f"run-{source}", extra)
            results[source] = {"file_GB": round(size / 2**30, 2), **result}
            print(f"{source}: {size / 2**30:.2f} GB, {result['train_samples']:,} training samples in one epoch at "
                  f"{result['train_samples_per_s']:,.0f} samples/s, {result['wall_s']:.0f} s in all; most RssAnon "
                  f"per rank {result['most_rss_anon_MB_per_rank']} MB", flush=True)
            shutil.rmtree(data) if data.is_dir() else data.unlink()
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

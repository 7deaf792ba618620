"""What sharding the optimizer state saves, and what it costs: a 50 M-parameter model with AdamW on
2 processes, sharded against unsharded, side by side in one run, under both engines.

    python benchmarks/sharded_optimizer.py [--repeats 2] [--epochs 2] [--device cpu]   (part of `make bench`)

Each rank's resident memory (RssAnon from /proc/self/status, read by a callback at the end of the
first epoch) is measured for three runs of the same model: AdamW unsharded, AdamW sharded, and plain
SGD without momentum (no optimizer state at all). The optimizer state's memory is a run's RssAnon
less the stateless run's; the ratio sharded/unsharded is the figure (at most 0.55 wanted at np=2).
Beside it, the same from the bytes glibc's allocator has handed out and not had back (mallinfo2): RssAnon
also holds the freed memory that `train.keep_freed_memory` keeps for the next step, hundreds of MiB
that differ from rank to rank and epoch to epoch.
Samples/s is the mean over the epochs after the first, the runs alternating, the median of the repeats.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import BIN, environment, host_settings  # noqa: E402

WIDTH, LAYERS = 2896, 6  # 6 layers of 2896 x 2896 (+ biases and a head): 50.4 M parameters
VARIANTS = {
    "adamw, unsharded": ["--optimizer", "adamw"],
    "adamw, --shard-optimizer": ["--optimizer", "adamw", "--shard-optimizer"],
    "sgd without momentum (no optimizer state)": ["--optimizer", "sgd", "--set", "optim.momentum=0"],
}
ENGINES = {"Horovod engine (horovodrun -np 2)": [str(BIN / "horovodrun"), "-np", "2"],
           "torch engine (torchrun --nproc-per-node 2)": [str(BIN / "torchrun"), "--nproc-per-node", "2"]}


def wide_mlp(input_shape, num_classes):
    """The benchmark's model: LAYERS linear layers of WIDTH, then a head."""
    from torch import nn

    layers: list[nn.Module] = [nn.Flatten()]
    width_in = input_shape[0]
    for _ in range(LAYERS):
        layers += [nn.Linear(width_in, WIDTH), nn.ReLU()]
        width_in = WIDTH
    return nn.Sequential(*layers, nn.Linear(WIDTH, num_classes))


class _Mallinfo2(ctypes.Structure):
    """glibc's mallinfo2(): byte counts of the heap (`arena`), of mmapped blocks (`hblkhd`), and of the
    heap's blocks in use (`uordblks`) and free but kept (`fordblks`)."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def allocated_bytes() -> int | None:
    """What glibc's allocator has handed out and not had back (heap blocks in use and mmapped ones):
    RssAnon less the freed memory it keeps for the next step (`train.keep_freed_memory`)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or one older than 2.33
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


class ResidentMemory:
    """Writes this rank's RssAnon and its allocated bytes at the end of the first epoch into
    RUN_DIR/rss-RANK.json."""

    def on_epoch_end(self, state):
        if state.epoch == 1:
            fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            kib = int(fields["RssAnon"].split()[0])
            (state.run_dir / f"rss-{state.rank}.json").write_text(
                json.dumps({"rss_anon": kib * 1024, "allocated": allocated_bytes()}))


def fit_once(launcher: list[str], flags: list[str], epochs: int, run_dir: Path,
             device: str = "auto") -> tuple[list[int], list[int], float]:
    """One run: each rank's RssAnon and allocated bytes after epoch 1, and samples/s over the later epochs."""
    import subprocess

    command = [*launcher, str(BIN / "hvdtrain"), "fit", "--model", "benchmarks.sharded_optimizer:wide_mlp",
               "--data", "random", "--set", f"data.features={WIDTH}", "--set", "data.samples=1200",
               "--batch-size", "16", "--epochs", str(epochs), "--progress", "off", "--no-tensorboard",
               "--callback", "benchmarks.sharded_optimizer:ResidentMemory", "--lr", "0.0001",
               "--run-dir", str(run_dir), "--overwrite", "--device", device, *flags]
    env = environment({**host_settings(), "PYTHONPATH": str(ROOT)})
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        sys.exit(f"bench: {' '.join(flags)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    memory = [json.loads((run_dir / f"rss-{rank}.json").read_text()) for rank in range(2)]
    rss, allocated = [m["rss_anon"] for m in memory], [m["allocated"] for m in memory]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    rate = sum(r["train_samples"] for r in records) / sum(r["train_samples"] / r["train_samples_per_s"] for r in records)
    return rss, allocated, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cpu: on a machine with one GPU, where two processes cannot share it")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "sharded_optimizer.json"))
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, list]]] = {
        engine: {variant: {"rss": [], "allocated": [], "rate": []} for variant in VARIANTS} for engine in ENGINES}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for engine, launcher in ENGINES.items():
                for variant, flags in VARIANTS.items():  # alternating: drift on a shared machine hits all alike
                    rss, allocated, rate = fit_once(launcher, flags, args.epochs, Path(scratch) / "run", args.device)
                    for name, value in (("rss", rss), ("allocated", allocated), ("rate", rate)):
                        results[engine][variant][name].append(value)
                    print(f"  run {repeat + 1}/{args.repeats}  {engine}  {variant}: RssAnon "
                          f"{[f'{r / 2**20:.0f} MiB' for r in rss]}, allocated "
                          f"{[f'{a / 2**20:.0f} MiB' if a is not None else '?' for a in allocated]}, "
                          f"{rate:,.1f} samples/s", flush=True)
    summary = {}
    for engine, by in results.items():
        summary[engine] = {}
        for measure in ("rss", "allocated"):
            if any(None in run for v in VARIANTS for run in by[v][measure]):
                continue  # no mallinfo2 here (not glibc, or one older than 2.33)
            held = {v: [statistics.median(r[rank] for r in by[v][measure]) for rank in range(2)] for v in VARIANTS}
            summary[engine].update(state_figures(measure, held))
        rate = {v: statistics.median(by[v]["rate"]) for v in VARIANTS}
        summary[engine].update({
            "samples_per_s": {v: round(r, 1) for v, r in rate.items()},
            "rate_ratio": round(rate["adamw, --shard-optimizer"] / rate["adamw, unsharded"], 3),
        })
    print(f"\n50.4 M parameters, AdamW, 2 processes, medians of {args.repeats}")
    for engine, figures in summary.items():
        print(engine)
        for measure, what in (("rss", "RssAnon"), ("allocated", "allocated bytes")):
            if f"{measure}_state_mib" not in figures:
                continue
            print(f"  optimizer state per rank ({what} less the stateless run's): unsharded "
                  f"{figures[f'{measure}_state_mib']['unsharded']} MiB, sharded "
                  f"{figures[f'{measure}_state_mib']['sharded']} MiB: ratio {figures[f'{measure}_state_ratio']}")
        print(f"  samples/s: unsharded {figures['samples_per_s']['adamw, unsharded']:,.1f}, sharded "
              f"{figures['samples_per_s']['adamw, --shard-optimizer']:,.1f}: ratio {figures['rate_ratio']}")
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "epochs": args.epochs, "results": summary},
                                         indent=2) + "\n")


def state_figures(measure: str, held: dict[str, list[float]]) -> dict:
    """The optimizer state's bytes per rank by one measure of each run's memory (`held`, per variant and
    rank): each AdamW run's less the stateless run's, and sharded over unsharded."""
    base, whole, sharded = (held[v] for v in ("sgd without momentum (no optimizer state)", "adamw, unsharded",
                                              "adamw, --shard-optimizer"))
    state = {"unsharded": [w - b for w, b in zip(whole, base)], "sharded": [s - b for s, b in zip(sharded, base)]}
    return {f"{measure}_mib": {v: [round(r / 2**20) for r in held[v]] for v in VARIANTS},
            f"{measure}_state_mib": {k: [round(r / 2**20) for r in v] for k, v in state.items()},
            f"{measure}_state_ratio": [round(s / u, 3) if u else None for s, u in zip(state["sharded"], state["unsharded"])]}


if __name__ == "__main__":
    main()

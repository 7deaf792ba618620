"""`make bench`: hvdtrain against what users would run instead, side by side.

    python benchmarks/run.py [--repeats 5] [--epochs 3]

Same model, data, per-process batch (64) and threads (1 per process on 2 processes,
every core for the single process). Contenders run in alternating order, several
times each; the table shows medians and the ratios, and benchmarks/results.json keeps
every figure. Epoch 1 of every run is warm-up and not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# horovodrun's own choice by default (MPI when Horovod has it); BENCH_CONTROLLER=--gloo or --mpi forces one.
CONTROLLER = os.environ.get("BENCH_CONTROLLER", "").split()

FIT, LOOP, DDP, SINGLE = ("hvdtrain fit (horovodrun -np 2)", "hand-written Horovod loop (horovodrun -np 2)",
                          "torchrun DDP, Gloo (--nproc-per-node 2)", "one process, all cores")
# Not in the targets; they show where fit's lead comes from.
FIT_GLOO = "hvdtrain fit (horovodrun --gloo -np 2)"
LOOP_TUNED = "hand-written loop + hvdtrain's host settings"


def host_settings() -> dict[str, str]:
    """What hvdtrain sets in each process, as environment variables for a script that does not."""
    from hvdtrain import host_memory
    from hvdtrain.engine.horovod import MPI_SETTINGS

    return {**MPI_SETTINGS, **host_memory.AS_ENVIRONMENT}


def contenders(epochs: int, run_dir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Name -> (command, extra environment)."""
    e = str(epochs)
    fit = ["hvdtrain", "fit", "--data", "benchmarks.jobs:synthetic", "--model", "benchmarks.jobs:small_cnn",
           "--batch-size", "64", "--epochs", e, "--lr", "0.01", "--progress", "off", "--run-dir", str(run_dir),
           "--overwrite"]
    loop = [sys.executable, "benchmarks/horovod_loop.py", e]
    horovodrun = ["horovodrun", *CONTROLLER, "-np", "2"]
    runs = {
        FIT: ([*horovodrun, *fit], {}),
        LOOP: ([*horovodrun, *loop], {}),
        DDP: (["torchrun", "--nproc-per-node", "2", "benchmarks/ddp.py", e], {}),
        SINGLE: ([sys.executable, "benchmarks/single.py", e], {}),
        LOOP_TUNED: ([*horovodrun, *loop], host_settings()),
    }
    if not CONTROLLER:
        runs[FIT_GLOO] = (["horovodrun", "--gloo", "-np", "2", *fit], {})
    return runs


def samples_per_s(name: str, output: str, run_dir: Path) -> float:
    if name.startswith("hvdtrain fit"):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
        return sum(r["train_samples"] for r in records) / sum(r["train_samples"] / r["train_samples_per_s"] for r in records)
    last = [line for line in output.splitlines() if '"samples_per_s"' in line][-1]
    # raw_decode: mpirun may glue another rank's output prefix onto the end of the line
    return json.JSONDecoder().raw_decode(last, last.index("{"))[0]["samples_per_s"]


def environment(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets it too; each script sets its own threads
    return env


def machine(controller: str) -> dict[str, str]:
    import horovod
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": str(len(os.sched_getaffinity(0))), "python": platform.python_version(),
            "torch": torch.__version__, "horovod": horovod.__version__, "controller": controller}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sampler-size", type=int, default=10**8)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results.json"))
    args = parser.parse_args()

    started = time.time()
    runs: dict[str, list[float]] = {}
    controller = "unknown"  # the one horovodrun chose, as hvdtrain fit reports it
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "fit"
        commands = contenders(args.epochs, run_dir)
        names = list(commands)
        for repeat in range(args.repeats):
            # Alternate the order so drift on a shared machine does not favour one contender.
            order = names if repeat % 2 == 0 else names[::-1]
            for name in order:
                command, extra = commands[name]
                done = subprocess.run(command, cwd=ROOT, env=environment(extra), capture_output=True, text=True,
                                      timeout=600)
                if done.returncode != 0:
                    sys.exit(f"bench: '{name}' failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
                rate = samples_per_s(name, done.stdout, run_dir)
                if name == FIT:
                    controller = json.loads((run_dir / "summary.json").read_text())["controller"]
                runs.setdefault(name, []).append(rate)
                print(f"  run {repeat + 1}/{args.repeats}  {name:<46} {rate:8.0f} samples/s", flush=True)

    medians = {name: statistics.median(rates) for name, rates in runs.items()}
    ratios = {
        "fit / torchrun DDP (target >= 1.10)": medians[FIT] / medians[DDP],
        "fit / hand-written Horovod loop (target >= 1.00)": medians[FIT] / medians[LOOP],
        "fit / one process all cores (target >= 1.00)": medians[FIT] / medians[SINGLE],
        "fit / hand-written loop + hvdtrain's host settings": medians[FIT] / medians[LOOP_TUNED],
    }
    with tempfile.NamedTemporaryFile(suffix=".json") as sampler_json:
        subprocess.run([sys.executable, "-m", "hvdtrain", "bench", "sampler", "--size", str(args.sampler_size),
                        "--world-size", "8", "--json", sampler_json.name],
                       cwd=ROOT, env=environment({}), capture_output=True, check=True)
        sampler_rows = json.loads(Path(sampler_json.name).read_text())

    print(f"\n{'contender':<46} {'median samples/s':>17}   runs")
    for name in names:
        print(f"{name:<46} {medians[name]:>17.0f}   {', '.join(f'{r:.0f}' for r in runs[name])}")
    print()
    for label, value in ratios.items():
        print(f"{label:<52} {value:6.3f}")
    for row in sampler_rows["rows"]:
        print(f"sampler {row['sampler']:<9} at {args.sampler_size:,} samples, world 8: first index "
              f"{row.get('first_index_ms', float('nan')):.2f} ms, extra peak {row.get('extra_peak_MB', float('nan')):.1f} MB")
    result = {"machine": machine(controller), "command": " ".join([*(f"BENCH_CONTROLLER={c}" for c in CONTROLLER), "make bench"]), "repeats": args.repeats, "epochs": args.epochs,
              "samples_per_s": runs, "median_samples_per_s": medians, "ratios": ratios,
              "sampler": sampler_rows, "wall_s": time.time() - started}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {args.out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

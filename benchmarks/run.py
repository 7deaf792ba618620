"""`make bench`: hvdtrain's two engines against what users would run instead, side by side.

    python benchmarks/run.py [--repeats 3] [--epochs 3] [--jobs linear,conv]

Two jobs (benchmarks/jobs.py): a linear-heavy one, where the gradient allreduce weighs,
and a convolution-heavy one, where compute does. For each: the same model, data,
per-process batch (64) and threads (1 per process on 2 processes, every core for the
single process), and its ceiling: two independent 1-thread processes on the same cores
with no communication at all. Contenders run in alternating order, several times
each; the tables show medians, the ratios and each contender's share of the ceiling,
and benchmarks/results.json keeps every figure. Epoch 1 of every run is warm-up and not
timed.
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
sys.path.insert(0, str(ROOT))  # run as a script: `benchmarks` itself is importable from the root
BIN = Path(sys.executable).parent
# horovodrun's own choice by default (MPI when Horovod has it); BENCH_CONTROLLER=--gloo or --mpi forces one.
CONTROLLER = os.environ.get("BENCH_CONTROLLER", "").split()

FIT = "hvdtrain fit, Horovod engine (horovodrun -np 2)"
FIT_TORCH = "hvdtrain fit, torch engine (torchrun --nproc-per-node 2)"
LOOP = "hand-written Horovod loop (horovodrun -np 2)"
DDP = "hand-written DDP, Gloo (torchrun --nproc-per-node 2)"
SINGLE = "one process, all cores"
CEILING = "ceiling: 2 independent 1-thread processes, no communication"
# Contenders whose figure is the sum of two processes' own (no launcher, no communication).
PAIRS = {CEILING}


def host_settings() -> dict[str, str]:
    """What hvdtrain sets in each process, as environment variables for a script that does not."""
    from hvdtrain.engine import host_memory
    from hvdtrain.engine.horovod import MPI_SETTINGS

    return {**MPI_SETTINGS, **host_memory.AS_ENVIRONMENT}


def contenders(job: str, epochs: int, run_dir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Name -> (command, extra environment) for one job."""
    from benchmarks.jobs import JOBS

    e = str(epochs)
    model, data = JOBS[job]
    fit = ["hvdtrain", "fit", "--data", f"benchmarks.jobs:{data}", "--model", f"benchmarks.jobs:{model}",
           "--batch-size", "64", "--epochs", e, "--lr", "0.01", "--progress", "off", "--run-dir", str(run_dir),
           "--overwrite", "--no-tensorboard"]
    torchrun = ["torchrun", "--nproc-per-node", "2"]
    horovodrun = ["horovodrun", *CONTROLLER, "-np", "2"]
    loop = [sys.executable, "benchmarks/horovod_loop.py", e, job]
    runs = {
        FIT: ([*horovodrun, *fit], {}),
        FIT_TORCH: ([*torchrun, "--no-python", *fit], {}),
        LOOP: ([*horovodrun, *loop], {}),
        DDP: ([*torchrun, "benchmarks/ddp.py", e, job], {}),
        SINGLE: ([sys.executable, "benchmarks/single.py", e, job], {}),
        # The most these cores do with this job: the host settings too, since any process may take them.
        CEILING: ([sys.executable, "benchmarks/single.py", e, job, "1"], host_settings()),
    }
    return runs


def measure(name: str, command: list[str], extra: dict[str, str], run_dir: Path) -> float:
    """One run's samples/s (all processes together)."""
    copies = 2 if name in PAIRS else 1
    started = [subprocess.Popen(command, cwd=ROOT, env=environment(extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(copies)]
    rate = 0.0
    for process in started:
        stdout, stderr = process.communicate(timeout=600)
        if process.returncode != 0:
            sys.exit(f"bench: '{name}' failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
        rate += samples_per_s(name, stdout, run_dir)
    return rate


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
    env.pop("OMP_NUM_THREADS", None)  # each contender sets its own threads (hvdtrain fit would take it as the user's)
    return env


def machine(controller: str) -> dict[str, str]:
    import horovod
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": str(len(os.sched_getaffinity(0))), "python": platform.python_version(),
            "torch": torch.__version__, "horovod": horovod.__version__, "controller": controller}


def ratios_of(job: str, medians: dict[str, float]) -> dict[str, float]:
    """The targets' ratios, then every contender's share of the job's ceiling."""
    ratios = {
        "torch engine / hand-written DDP (target >= 1.00)": medians[FIT_TORCH] / medians[DDP],
        "Horovod engine / hand-written DDP": medians[FIT] / medians[DDP],
        "Horovod engine / hand-written Horovod loop (target >= 1.00)": medians[FIT] / medians[LOOP],
        "Horovod engine / one process all cores (target >= 1.00)": medians[FIT] / medians[SINGLE],
        "torch engine / one process all cores": medians[FIT_TORCH] / medians[SINGLE],
    }
    for name, median in medians.items():
        if name != CEILING:
            goal = " (goal >= 0.95)" if name in (FIT, FIT_TORCH) else ""
            ratios[f"share of the ceiling: {name}{goal}"] = median / medians[CEILING]
    return ratios


def main() -> None:
    from benchmarks.jobs import JOBS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated, of: " + ", ".join(JOBS))
    parser.add_argument("--sampler-size", type=int, default=10**8)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results.json"))
    args = parser.parse_args()
    jobs = args.jobs.split(",")

    started = time.time()
    runs: dict[str, dict[str, list[float]]] = {job: {} for job in jobs}
    controller = "unknown"  # the one horovodrun chose, as hvdtrain fit reports it
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "fit"
        commands = {job: contenders(job, args.epochs, run_dir) for job in jobs}
        for repeat in range(args.repeats):
            for job in jobs:
                # Alternate the order so drift on a shared machine does not favour one contender.
                names = list(commands[job])
                for name in names if repeat % 2 == 0 else names[::-1]:
                    rate = measure(name, *commands[job][name], run_dir)
                    if name == FIT:
                        controller = json.loads((run_dir / "summary.json").read_text())["controller"]
                    runs[job].setdefault(name, []).append(rate)
                    print(f"  run {repeat + 1}/{args.repeats}  {job:<6} {name:<62} {rate:8.0f} samples/s", flush=True)

    medians = {job: {name: statistics.median(rates) for name, rates in by_name.items()} for job, by_name in runs.items()}
    ratios = {job: ratios_of(job, medians[job]) for job in jobs}
    with tempfile.NamedTemporaryFile(suffix=".json") as sampler_json:
        subprocess.run([sys.executable, "-m", "hvdtrain", "bench", "sampler", "--size", str(args.sampler_size),
                        "--world-size", "8", "--json", sampler_json.name],
                       cwd=ROOT, env=environment({}), capture_output=True, check=True)
        sampler_rows = json.loads(Path(sampler_json.name).read_text())

    for job in jobs:
        print(f"\njob {job}\n{'contender':<62} {'median samples/s':>17}   runs")
        for name, rates in runs[job].items():
            print(f"{name:<62} {medians[job][name]:>17.0f}   {', '.join(f'{r:.0f}' for r in rates)}")
        for label, value in ratios[job].items():
            print(f"  {label:<100} {value:6.3f}")
    print()
    for row in sampler_rows["rows"]:
        print(f"sampler {row['sampler']:<9} at {args.sampler_size:,} samples, world 8: first index "
              f"{row.get('first_index_ms', float('nan')):.2f} ms, extra peak {row.get('extra_peak_MB', float('nan')):.1f} MB")
    command = " ".join([*(f"BENCH_CONTROLLER={c}" for c in CONTROLLER), "make bench"])
    result = {"machine": machine(controller), "command": command, "repeats": args.repeats, "epochs": args.epochs,
              "samples_per_s": runs, "median_samples_per_s": medians, "ratios": ratios,
              "sampler": sampler_rows, "wall_s": time.time() - started}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {args.out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

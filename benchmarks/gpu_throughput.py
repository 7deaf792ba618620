"""`hvdtrain fit` against a plain PyTorch loop on one GPU: a ResNet-50-shaped network
(benchmarks/resnet.py) on synthetic 3x224x224 images, batch 128, fp32 and bf16, channels-last,
one process. launch/gpu-check.sh runs it on the GPU machine.

    python benchmarks/gpu_throughput.py --json throughput.json
    python benchmarks/gpu_throughput.py --device cpu --image-size 32 --batch 8 --steps 4   # a smoke run
    python benchmarks/gpu_throughput.py --launcher "horovodrun --gloo -np 1"   # fit under a launcher

Both train on the same images held in host memory. `hvdtrain fit` runs 3 epochs of `--steps` steps
and reports the last two together (the first warms up); the plain loop takes contiguous batches from pinned
memory with non-blocking copies, and is also timed on one batch already on the GPU: the model's
own ceiling. Each contender runs in a process of its own. Model FLOP utilisation: samples/s times
the counted training FLOPs of a sample, over the device's dense peak for the math the run uses
(fp32 convolutions run as TF32 while torch.backends.cudnn.allow_tf32 is on, its default).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: `benchmarks` itself is importable from the root

# Dense peaks, TFLOP/s, by a part of the device's name (H100 SXM; the H200 has the same).
PEAK_TFLOPS = {"H100": {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0},
               "H200": {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}}
LR = 0.01  # both contenders: SGD, momentum 0.9, this learning rate, unscaled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=40, help="Steps per epoch (hvdtrain) and timed steps (plain).")
    parser.add_argument("--precisions", default="32,bf16")
    parser.add_argument("--json", help="Write the result here.")
    parser.add_argument("--launcher", default="", help="Start fit under this launcher (its engine), e.g. "
                        "'torchrun --nproc-per-node 1'; by default alone (the local engine).")
    parser.add_argument("--plain", help=argparse.SUPPRESS)  # a precision: run the plain loop here, print JSON
    args = parser.parse_args()
    os.environ.update(BENCH_IMAGE_SIZE=str(args.image_size), BENCH_TRAIN_SAMPLES=str(args.steps * args.batch),
                      BENCH_VAL_SAMPLES=str(args.batch))
    if args.plain:
        print(json.dumps(plain_loop(args.plain, args.device, args.batch, args.steps)))
        return
    result = compare(args)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


def compare(args: argparse.Namespace) -> dict:
    rows = []
    facts: dict = {}
    for precision in args.precisions.split(","):
        plain = _json_of([sys.executable, __file__, "--plain", precision, "--device", args.device,
                          "--batch", str(args.batch), "--image-size", str(args.image_size), "--steps", str(args.steps)])
        facts = {k: plain.pop(k) for k in ("device_name", "flops_per_sample", "cudnn_allow_tf32", "matmul_precision")}
        fit = hvdtrain_fit(precision, args)
        peak = _peak(facts["device_name"], precision, facts["cudnn_allow_tf32"])
        row = {"precision": precision, "hvdtrain_samples_per_s": fit, **plain,
               "ratio": fit / plain["plain_samples_per_s"] if fit and plain["plain_samples_per_s"] else None,
               "peak_tflops": peak}
        for name in ("hvdtrain", "plain", "resident"):
            rate = row["hvdtrain_samples_per_s" if name == "hvdtrain" else f"{name}_samples_per_s"]
            row[f"mfu_{name}"] = rate * facts["flops_per_sample"] / (peak * 1e12) if peak and rate else None
        rows.append(row)
    return {"model": "ResNet-50 layout (benchmarks/resnet.py)", "batch": args.batch, "image_size": args.image_size,
            "steps": args.steps, "launcher": args.launcher or None, "channels_last": True, "device": args.device, **facts, "rows": rows}


def _peak(device_name: str, precision: str, tf32: bool) -> float | None:
    for part, peaks in PEAK_TFLOPS.items():
        if part in device_name:
            return peaks["bf16"] if precision == "bf16" else peaks["tf32" if tf32 else "fp32"]
    return None


def _json_of(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"gpu_throughput: {' '.join(command[1:3])} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


FIT_EPOCHS = 3  # the first warms up; the others are timed together (one epoch of 40 steps is 1.5 s on an H200)


def hvdtrain_fit(precision: str, args: argparse.Namespace) -> float:
    """Samples/s of `hvdtrain fit`'s epochs after the first, together."""
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = str(Path(scratch) / "run")
        command = [*shlex.split(args.launcher), "hvdtrain", "fit", "--model", "benchmarks.resnet:resnet50", "--data", "benchmarks.resnet:synthetic_images",
                   "--set", "data.num_classes=1000", "--batch-size", str(args.batch), "--epochs", str(FIT_EPOCHS),
                   "--precision", precision, "--channels-last", "--device", args.device, "--lr", str(LR), "--no-scale-lr",
                   "--progress", "off", "--no-tensorboard", "--run-dir", run_dir]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        if done.returncode != 0:
            raise SystemExit(f"gpu_throughput: hvdtrain fit --precision {precision} failed: {done.stderr.strip()[-2000:]}")
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:]  # samples over seconds, over these epochs together
    return sum(r["train_samples"] for r in timed) / sum(r["train_samples"] / r["train_samples_per_s"] for r in timed)


def plain_loop(precision: str, device_name: str, batch: int, steps: int) -> dict:
    """The loop a user writes: forward under autocast, backward, SGD step; no per-step sync."""
    import torch
    import torch.nn.functional as F

    from benchmarks.resnet import resnet50, synthetic_images, training_flops_per_sample

    device = torch.device(device_name)
    torch.manual_seed(0)
    train, _ = synthetic_images()
    images, labels = train.tensors
    if device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    model = resnet50().to(device).to(memory_format=torch.channels_last)
    flops = training_flops_per_sample(model, images.shape[-1], device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def from_host(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = slice((i % steps) * batch, (i % steps + 1) * batch)
        x = images[part].to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        return x, labels[part].to(device, non_blocking=True)

    resident = from_host(0)
    fed = _timed(lambda i: step(*from_host(i)), steps, batch, device)
    ceiling = _timed(lambda i: step(*resident), steps, batch, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"plain_samples_per_s": fed, "resident_samples_per_s": ceiling, "device_name": name,
            "flops_per_sample": flops, "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_precision": torch.get_float32_matmul_precision()}


def _timed(step, steps: int, batch: int, device) -> float:
    """Samples/s over `steps` steps after a quarter as many (at least 2) of warm-up."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(max(2, steps // 4)):
        step(i)
    sync()
    started = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    return steps * batch / (time.perf_counter() - started)


if __name__ == "__main__":
    main()

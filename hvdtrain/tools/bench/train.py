"""Training throughput on synthetic data, in the manner of Horovod's synthetic benchmark.

Warm-up steps, then `repeats` timed rounds of `steps` steps; samples/s per process
with a 95% confidence interval, and in total. With `scaling`, rank 0 then trains
alone (same threads, no allreduce) while the others wait, giving the efficiency
total / (world size x one process).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from hvdtrain.tools.bench.stats import mean_ci95
from hvdtrain.engine import Engine, GradientSync
from hvdtrain.data.batch import to_device
from hvdtrain.train.loop import apply_gradients, forward_backward
from hvdtrain.numerics.precision import FP32, Precision
from hvdtrain.tasks import Task
from hvdtrain.tasks.builtin import Classification


def _round_rates(model: nn.Module, optimizer: torch.optim.Optimizer, engine: Engine, inputs: torch.Tensor,
                 targets: torch.Tensor, warmup: int, steps: int, repeats: int,
                 precision_mode: str = FP32) -> list[float]:
    precision = Precision(precision_mode, engine.device)
    task: Task = Classification()

    def step() -> None:  # the calls hvdtrain.train.loop.train_epoch makes per step
        forward_backward(model, task, (inputs, targets), precision)
        apply_gradients(model, optimizer, engine, clip_grad_norm=None, precision=precision)

    model.train()
    for _ in range(warmup):
        step()
    rates = []
    for _ in range(repeats):
        sync(engine.device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(engine.device)
        rates.append(steps * len(inputs) / (time.perf_counter() - start))
    return rates


def run(engine: Engine, model: nn.Module, input_shape: tuple[int, ...], num_classes: int, *, batch_size: int,
        warmup: int = 5, steps: int = 10, repeats: int = 5, scaling: bool = False,
        compression: str = "none", precision: str = FP32, channels_last: bool = False) -> dict[str, Any]:
    model = model.to(engine.device)
    generator = torch.Generator().manual_seed(0)
    inputs, targets = to_device((torch.randn(batch_size, *input_shape, generator=generator),
                                 torch.randint(0, num_classes, (batch_size,), generator=generator)),
                                engine.device, channels_last)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    engine.broadcast_parameters(model)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model,
                                      GradientSync(compression=compression))
    rates = _round_rates(model, optimizer, engine, inputs, targets, warmup, steps, repeats, precision)
    # dist: every rank's rounds, so the interval covers all processes.
    everyone = [r for ranks in engine.allgather_object(rates, "bench.train.rates") for r in ranks]
    per_process, ci = mean_ci95(everyone)
    result: dict[str, Any] = {
        "world_size": engine.size, "batch_size": batch_size, "device": _device_name(engine.device),
        "precision": precision,
        "parameters": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads(),
        "samples_per_s_per_process": per_process, "ci95": ci, "samples_per_s_total": per_process * engine.size,
    }
    if scaling:
        result.update(_scaling(engine, model, inputs, targets, warmup, steps, repeats, result["samples_per_s_total"],
                               precision))
    return result


def _scaling(engine: Engine, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, warmup: int,
             steps: int, repeats: int, total: float, precision: str) -> dict[str, Any]:
    from hvdtrain.engine import LocalEngine

    single = None
    if engine.is_root:
        # A copy: the original's parameters carry Horovod's allreduce hooks.
        alone_model = copy.deepcopy(model)
        plain = torch.optim.SGD(alone_model.parameters(), lr=0.01, momentum=0.9)
        single = mean_ci95(_round_rates(alone_model, plain, LocalEngine(engine.device), inputs, targets,
                                        warmup, steps, repeats, precision))[0]
    single = engine.broadcast_object(single, "bench.train.single")  # others wait here
    return {"single_process_samples_per_s": single, "scaling_efficiency": total / (engine.size * single)}


def _device_name(device: torch.device) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def sync(device: torch.device) -> None:
    """Waits for the device's queued work, so that the host's clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(result: dict[str, Any]) -> str:
    text = (f"train: {result['parameters']:,} parameters, batch {result['batch_size']} per process, "
            f"{result['world_size']} processes x {result['threads']} threads on {result['device']}, "
            f"precision {result['precision']}\n"
            f"  per process: {result['samples_per_s_per_process']:,.1f} +- {result['ci95']:,.1f} samples/s (95% CI)\n"
            f"  total:       {result['samples_per_s_total']:,.1f} samples/s")
    if "scaling_efficiency" in result:
        text += (f"\n  one process: {result['single_process_samples_per_s']:,.1f} samples/s; "
                 f"scaling efficiency {result['scaling_efficiency']:.2f}")
    return text

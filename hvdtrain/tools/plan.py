"""`hvdtrain plan`: what each rank of a `fit` will do, worked out before anything trains.

    hvdtrain plan --np 4 --batch-size 32          # alone: 4 processes on this host
    horovodrun -np 4 hvdtrain plan --batch-size 32  # under the launcher: the real ranks

Every number comes from the pieces `fit` uses (the sampler, the learning-rate schedule,
the device choice), not from a second calculation of them.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from hvdtrain.config import Config
from hvdtrain.data.loading import collate_function
from hvdtrain.data.sources import build_data
from hvdtrain.tools.doctor import gpus
from hvdtrain.engine.environment import threads_per_process
from hvdtrain.data.sampler import EvalShardSampler
from hvdtrain.data.stream_sampler import training_sampler
from hvdtrain.data.streams import StreamDataset
from hvdtrain.engine.powersgd import sent_values
from hvdtrain.engine.sharded import held_bytes
from hvdtrain.models import ModelShapes
from hvdtrain.numerics.precision import Precision
from hvdtrain.train.lazy_modules import make_lazy_weights
from hvdtrain.train.schedule import learning_rate
from hvdtrain.io.progress import mib
from hvdtrain.train.setup import make_optimizer
from hvdtrain.train.steps import StepCount
from hvdtrain.tasks import build_task

SHOWN_INDICES = 8


def rank_facts(rank: int, local_rank: int, size: int, local_size: int, device: str, threads: int,
               started_device: str | None = None) -> dict[str, Any]:
    """One rank's place: where it runs, on which device (and physical GPU), with how many threads."""
    gpu = gpus(range(local_rank, local_rank + 1))["local_rank_gpu"][local_rank]  # "cuda:r (physical p)"
    if started_device is not None:  # under a launcher: the engine chose it already
        chosen = gpu if started_device.startswith("cuda") and gpu else started_device
    elif device == "cpu" or (device == "auto" and gpu is None):
        chosen = "cpu"
    else:  # dist: local rank r takes cuda:r, counted among the GPUs CUDA_VISIBLE_DEVICES leaves visible
        chosen = gpu or f"cuda:{local_rank} (not visible here: fit would stop)"
    return {"rank": rank, "local_rank": local_rank, "world_size": size, "local_size": local_size,
            "host": platform.node(), "device": chosen, "threads": threads_per_process(threads, local_size)}


def make_plan(config: Config, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    size = len(ranks)
    task = build_task(config.task)
    split = build_data(config.data, config.train.seed, task.target_key)
    n_train, n_val = len(split.train), len(split.val)  # type: ignore[arg-type]
    batch, accumulate = config.data.batch_size, config.train.accumulate
    samplers = [training_sampler(split.train, batch, r, size, seed=config.train.seed, multiple=accumulate,
                                 buffer=config.data.shuffle_buffer, workers=0) for r in range(size)]
    for sampler in samplers:
        sampler.begin_epoch(1)  # fit's first epoch
    steps = StepCount.of(samplers[0], accumulate)
    lr = learning_rate(config, steps)
    val = [EvalShardSampler(n_val, batch, r, size) for r in range(size)]
    first = [next(iter(s), []) for s in samplers]
    model = ModelShapes(split.input_shape, split.num_classes,
                        task.num_outputs(split.num_classes, split.target_shape)).build(config.model)
    cpu = torch.device("cpu")
    make_lazy_weights(model, task, split.train, collate_function(config.data.collate, config.task.ignore_index,
                                                                 task.target_key), cpu,
                      Precision(config.train.precision, cpu).autocast())  # as fit makes them
    params = [p for p in model.parameters() if p.requires_grad]
    memory = memory_per_rank(config, model, size)
    return {
        "world_size": size, "data": config.data.name, "task": task.name, "train_samples": n_train,
        "val_samples": n_val, "epochs": config.train.epochs,
        "ranks": [{**facts, "val_first": v.start, "val_stop": v.stop, "first_batch": f}
                  for facts, v, f in zip(ranks, val, first)],
        "batch_per_rank": batch, "accumulate": accumulate, "global_batch": steps.samples,
        "steps_per_epoch": steps.per_epoch, "samples_per_epoch": steps.per_epoch * steps.samples,
        "dropped_per_epoch": samplers[0].dropped, "stream": isinstance(split.train, StreamDataset),
        "lr": {"base": lr.base, "scale": lr.scale, "lr_batch": lr.lr_batch, "peak": lr.base * lr.scale, "first_step": lr(0),
               "warmup_steps": lr.warmup_steps, "schedule": lr.schedule, "total_steps": lr.total_steps,
               "last_step": lr(max(0, lr.total_steps - 1))},
        "adasum": config.train.adasum,
        "shard_optimizer": config.train.shard_optimizer,
        "compression": config.train.compression,
        "memory": memory,
        "sent_per_step": sent_per_step(memory[0]["parameters"], size, config.train.shard_optimizer,
                                       powersgd_bytes=4 * sent_values(params, config.train.powersgd_rank)),
    }


def sent_per_step(parameter_bytes: int, size: int, sharded: bool, powersgd_bytes: int = 0) -> dict[str, int]:
    """The bytes each rank sends per optimizer step, with each compression. An allreduce (ring, or
    reduce-scatter then all-gather) sends 2(N-1)/N of the gradients; sharded, the reduce-scatter sends
    (N-1)/N of them and the all-gather (N-1)/N of the parameters, in fp32. fp16 and bf16 halve what
    is sent as gradients (bf16 as a reduce-scatter and an all-gather: the same bytes). PowerSGD sums
    `powersgd_bytes` (its factors, and the tensors it sends whole) as an allreduce would; not sharded."""
    share = (size - 1) / size
    gradients = share * parameter_bytes * (1 if sharded else 2)
    parameters = share * parameter_bytes if sharded else 0
    sent = {name: int(gradients * factor + parameters) for name, factor in (("none", 1), ("fp16", 0.5), ("bf16", 0.5))}
    return sent if sharded else {**sent, "powersgd": int(2 * share * powersgd_bytes)}


def memory_per_rank(config: Config, model: torch.nn.Module, size: int) -> list[dict[str, int]]:
    """What each rank holds, in bytes: `model` (built as fit builds it), and its optimizer's state measured
    after one step on zero gradients (any optimizer, a user's too)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, model)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    state = {p: sum(t.numel() * t.element_size() for t in optimizer.state[p].values() if isinstance(t, torch.Tensor))
             for p in params}
    return held_bytes(params, size, state, config.train.shard_optimizer)


def render(plan: dict[str, Any]) -> str:
    ranks, lr = plan["ranks"], plan["lr"]
    lines = [f"hvdtrain plan: world size {plan['world_size']}, task {plan['task']}, data {plan['data']}: "
             f"{plan['train_samples']} training and {plan['val_samples']} validation samples, "
             f"{plan['epochs']} epochs", ""]
    rows = [("rank", "local rank", "host", "device", "threads", "validation samples")]
    for r in ranks:
        rows.append((str(r["rank"]), str(r["local_rank"]), r["host"], r["device"], str(r["threads"]),
                     f"{r['val_first']}..{r['val_stop'] - 1} ({r['val_stop'] - r['val_first']})"
                     if r["val_stop"] > r["val_first"] else "none"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    accumulate = f" x accumulate {plan['accumulate']}" if plan["accumulate"] > 1 else ""
    dropped = plan["dropped_per_epoch"]
    lines += [
        "",
        f"batch: {plan['batch_per_rank']} per rank x {plan['world_size']} ranks{accumulate} = global batch "
        f"{plan['global_batch']} per optimizer step",
        f"steps per epoch: {plan['steps_per_epoch']} ({plan['samples_per_epoch']} samples); "
        + (f"{dropped} samples of each epoch's shuffle are left out (a different {dropped} each epoch: the "
           f"{'end of the stream' if plan.get('stream') else 'last partial global batch'})" if dropped
           else "no sample is left out"),
        _lr_line(plan, lr),
        *_memory_lines(plan),
        _traffic_line(plan),
        "",
        "first global batch (epoch 1, step 1), indices into the training set:",
    ]
    for r in ranks:
        shown = r["first_batch"][:SHOWN_INDICES]
        more = f", ... ({len(r['first_batch'])} in all)" if len(r["first_batch"]) > SHOWN_INDICES else ""
        lines.append(f"  rank {r['rank']}: [{', '.join(map(str, shown))}{more}]")
    return "\n".join(lines)


def _memory_lines(plan: dict[str, Any]) -> list[str]:
    memory = plan["memory"]

    def held(entry: dict[str, int]) -> str:
        return (f"parameters {mib(entry['parameters'])}, gradients {mib(entry['gradients'])}, optimizer state "
                f"{mib(entry['optimizer_state'])}")

    if not plan["shard_optimizer"]:
        return [f"memory per rank (trainable parameters, all on every rank): {held(memory[0])}"]
    return ["memory per rank, optimizer state sharded (each rank steps its share; gradients after the "
            "reduce-scatter):"] + [f"  rank {rank}: {held(entry)}" for rank, entry in enumerate(memory)]


def _traffic_line(plan: dict[str, Any]) -> str:
    if plan["world_size"] == 1:
        return "sent per optimizer step: nothing (one process)"
    if plan["adasum"]:
        return "sent per optimizer step: Adasum's, in fp32 (its own pattern of exchanges)"
    sent = [f"{mib(nbytes)} with {name}{' (this run)' if name == plan['compression'] else ''}"
            for name, nbytes in plan["sent_per_step"].items()]
    return f"sent per optimizer step by each rank: {', '.join(sent)}"


def _lr_line(plan: dict[str, Any], lr: dict[str, Any]) -> str:
    if plan["adasum"]:
        scaled = f"{lr['base']:g} (Adasum: not scaled)"
    elif lr["scale"] == 1:
        scaled = f"{lr['base']:g} (not scaled)"
    else:
        scaled = (f"{lr['base']:g} for a batch of {lr['lr_batch']} x {lr['scale']:g} (the global batch over "
                  f"{lr['lr_batch']}) = {lr['peak']:g}")
    warmup = (f", reached after a linear warm-up over {lr['warmup_steps']} steps starting at {lr['first_step']:g}"
              if lr["warmup_steps"] else "")
    after = "then constant" if lr["schedule"] == "constant" else \
        f"then {lr['schedule']} to {lr['last_step']:.3g} at the last step"
    return f"learning rate: {scaled}{warmup}; {after}"

"""The input pipeline alone: a data set's training batches per second for each number of
data-loader workers, beside the rate of the training step itself, and which of the two bounds
a run. One process (or each rank under a launcher, reporting rank 0's shard), as `fit` builds
the data, model and task from the same flags. Images whose batches are augmented on the device
(hvdtrain.data.augment) have the augmentation timed apart, and added to the step's time.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from hvdtrain.config import Config
from hvdtrain.data.augment import on_device, prepared
from hvdtrain.data.batch import to_device
from hvdtrain.data.loading import batches
from hvdtrain.data.sampler import TrainingSampler
from hvdtrain.engine import Engine
from hvdtrain.errors import UserError
from hvdtrain.tools.bench.train import sync
from hvdtrain.train.loop import apply_gradients, forward_backward
from hvdtrain.train.setup import Run, build, check_same_data, train_sampler


MIN_SECONDS = 1.0


def run(config: Config, engine: Engine, worker_counts: list[int], count: int, steps: int) -> dict[str, Any]:
    """Samples/s of `count` batches per worker count (after the first, which waits for the workers
    to start), and of `steps` training steps on one of those batches."""
    with engine.agree("bench.data.build"):  # dist: a failure on one rank stops every rank, not only its own
        built = build(config, engine)
    check_same_data(built, engine)
    batch_size = config.data.batch_size

    def sampler_for(workers: int) -> TrainingSampler:  # a stream's sampler tells each worker what it will read
        return train_sampler(built.split.train, config, engine.rank, engine.size, workers)

    sampler = sampler_for(0)
    if len(sampler) < 2:
        raise UserError(f"the training set has {len(built.split.train)} samples, fewer than two batches of "
                        f"{batch_size} per process: lower --batch-size")
    with engine.agree("bench.data.input"):
        # Each worker count starts in an order of its own, not on the batches the one before just read.
        rows = [_input_rate(built, sampler_for(workers), workers, count, batch_size, 1000 * index)
                for index, workers in enumerate(worker_counts)]
    step = _step_rate(built, config, engine, sampler, steps, batch_size)
    augment = _augment_rate(built, engine, sampler, steps, batch_size)
    return {"data": config.data.name, "batch_size": batch_size, "world_size": engine.size,
            "train_samples": len(built.split.train), "rows": rows, "step_samples_per_s": step,
            "augment_samples_per_s": augment, "device": engine.device.type,
            "verdict": verdict(rows, step if augment is None else 1 / (1 / step + 1 / augment))}


def _input_rate(built: Run, sampler: TrainingSampler, workers: int, count: int, batch_size: int,
                epoch: int) -> dict:
    """At least `count` batches and a second (a pause of the machine is a small share), after the first."""
    sampler.begin_epoch(epoch)
    loader = batches(built.split.train, sampler, workers, pin_memory=False, collate=built.collate)
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first = time.perf_counter() - started
    done, started = 0, time.perf_counter()
    while done < count or time.perf_counter() - started < MIN_SECONDS:
        try:
            next(iterator)
        except StopIteration:  # the epoch ran out: the next one's order goes on
            sampler.begin_epoch(sampler.epoch + 1)
            iterator = iter(loader)
            continue
        done += 1
    seconds = time.perf_counter() - started
    del iterator, loader  # its workers end here, before the next count's start
    return {"workers": workers, "samples_per_s": done * batch_size / seconds, "first_batch_s": first}


def _step_rate(built: Run, config: Config, engine: Engine, sampler: TrainingSampler, steps: int,
               batch_size: int) -> float:
    batch = prepared(built.split.train, _device_batch(built, engine, sampler))
    batch = to_device(batch, engine.device, config.train.channels_last)
    built.model.train()

    def step(number: int) -> None:
        forward_backward(built.model, built.task, batch, built.precision)
        apply_gradients(built.model, built.optimizer, engine, config.optim.clip_grad_norm, built.precision)

    # dist: each step allreduces, so every rank goes on by rank 0's clock
    return _rate(step, engine, steps, batch_size, agree=engine.size > 1)


def _augment_rate(built: Run, engine: Engine, sampler: TrainingSampler, steps: int, batch_size: int) -> float | None:
    """Samples/s of the augmentation on the device alone; None for data that has none."""
    augment = on_device(built.split.train)
    if augment is None:
        return None
    batch = _device_batch(built, engine, sampler)
    return _rate(lambda number: augment(batch, 0, number, engine.rank), engine, steps, batch_size, agree=False)


def _device_batch(built: Run, engine: Engine, sampler: TrainingSampler) -> Any:
    return to_device(next(iter(batches(built.split.train, sampler, 0, False, built.collate))), engine.device)


def _rate(work: Callable[[int], Any], engine: Engine, steps: int, batch_size: int, agree: bool) -> float:
    """Samples/s of `work` done on one batch at least `steps` times and for a second (a pause of the
    machine is then a small share), after one call to warm up (allocations, first kernels)."""
    work(0)
    done, seconds = 0, 0.0
    while done < steps or seconds < MIN_SECONDS:
        started = time.perf_counter()
        for number in range(done + 1, done + 1 + steps):
            work(number)
        sync(engine.device)
        done, seconds = done + steps, seconds + time.perf_counter() - started
        if agree:
            seconds = engine.broadcast_object(seconds, "bench.data.seconds")
    return done * batch_size / seconds


def verdict(rows: list[dict], step: float) -> str:
    """Which bounds the run, and the setting to change."""
    enough = [row for row in rows if row["samples_per_s"] >= step]
    if not enough:
        best = max(rows, key=lambda row: row["samples_per_s"])
        return (f"input-bound: the input pipeline gives at most {best['samples_per_s']:,.0f} samples/s "
                f"(data.num_workers={best['workers']}), the training step takes {step:,.0f}: try more workers "
                "(--num-workers), a cheaper __getitem__ or data on faster storage")
    fewest = min(enough, key=lambda row: row["workers"])
    return (f"compute-bound: data.num_workers={fewest['workers']} already gives {fewest['samples_per_s']:,.0f} "
            f"samples/s, more than the training step's {step:,.0f}")


def table(result: dict[str, Any]) -> str:
    lines = [f"input pipeline of {result['data']}: {result['train_samples']:,} training samples, batch "
             f"{result['batch_size']} per process, world size {result['world_size']}",
             f"{'workers':>8} {'samples/s':>12} {'first batch (s)':>16}   (per process)"]
    lines += [f"{row['workers']:>8} {row['samples_per_s']:>12,.0f} {row['first_batch_s']:>16.2f}"
              for row in result["rows"]]
    lines.append(f"training step: {result['step_samples_per_s']:,.0f} samples/s per process")
    augment = result.get("augment_samples_per_s")
    if augment is not None:
        lines.append(f"augmentation on the device ({result['device']}): {augment:,.0f} samples/s per process "
                     f"({1000 * result['batch_size'] / augment:.1f} ms a batch), taken from the step's time")
    lines.append(result["verdict"])
    return "\n".join(lines)

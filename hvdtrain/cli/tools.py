"""The tools beside training: the `bench` group (allreduce, train, sampler, data), `doctor` and `config`."""

from __future__ import annotations

import sys
from typing import Any, Sequence

import click

from hvdtrain.cli.common import UserPath, command_engine, is_rank_0, not_stdout, report
from hvdtrain.cli.fit import fit_config, fit_options
from hvdtrain.config import describe
from hvdtrain.errors import UserError


@click.group()
def bench() -> None:
    """Measure: allreduce bandwidth, training throughput, sampler cost, the input pipeline."""


@bench.command("allreduce")
@click.option("--min-bytes", type=int, default=4 << 10, show_default=True)
@click.option("--max-bytes", type=int, default=256 << 20, show_default=True)
@click.option("--iterations", type=int, default=5, show_default=True, help="Timed allreduces per size.")
@click.option("--plot", type=UserPath(dir_okay=False), help="Write bandwidth against size to this PNG.")
@click.option("--json", "json_path", type=UserPath(dir_okay=False), help="Write the rows as JSON.")
def bench_allreduce(min_bytes: int, max_bytes: int, iterations: int, plot: str | None, json_path: str | None) -> None:
    """Allreduce time, algorithm and bus bandwidth from 4 KB to 256 MB (run under a launcher)."""
    from hvdtrain.tools.bench import allreduce
    from hvdtrain.tools.bench.stats import plot as draw

    not_stdout(plot, "plot")
    if not 4 <= min_bytes <= max_bytes:
        raise UserError(f"--min-bytes must be at least 4 and at most --max-bytes, got {min_bytes} and {max_bytes}")

    with command_engine(False) as engine:
        rows = allreduce.run(engine, min_bytes, max_bytes, iterations)
        if engine.is_root:  # dist: rank 0 reports
            report(allreduce.table(rows, engine), json_path,
                   {"world_size": engine.size, "controller": engine.controller, "rows": rows})
            if plot:
                draw(plot, [r["bytes"] for r in rows], {"algbw": [r["algbw_GBps"] for r in rows],
                                                         "busbw": [r["busbw_GBps"] for r in rows]},
                     xlabel="message size (bytes)", ylabel="GB/s", logx=True,
                     title=f"allreduce, {engine.size} processes, {engine.controller}")


@bench.command("train")
@click.option("--model", default="cnn", show_default=True, help="mlp, cnn or package.module:function.")
@click.option("--hidden", type=int, default=32, show_default=True, help="Width of the built-in models.")
@click.option("--input-shape", default="3,32,32", show_default=True, help="Synthetic input shape, comma-separated.")
@click.option("--classes", type=int, default=10, show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True, help="Per process.")
@click.option("--warmup", type=int, default=5, show_default=True, help="Untimed steps first.")
@click.option("--steps", type=int, default=10, show_default=True, help="Steps per timed round.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed rounds.")
@click.option("--scaling", is_flag=True, help="Also time one process alone and report the scaling efficiency.")
@click.option("--compression", type=click.Choice(["none", "fp16", "bf16", "powersgd"]), default="none", show_default=True)
@click.option("--precision", type=click.Choice(["32", "bf16", "fp16"]), default="32", show_default=True)
@click.option("--channels-last", is_flag=True, help="Channels-last memory format for 4-d inputs.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=int, default=0, help="Torch threads per process (0: cores / local processes).")
@click.option("--plot", type=UserPath(dir_okay=False), help="Write samples/s per round to this PNG.")
@click.option("--json", "json_path", type=UserPath(dir_okay=False), help="Write the result as JSON.")
def bench_train(model: str, hidden: int, input_shape: str, classes: int, batch_size: int, warmup: int, steps: int,
                repeats: int, scaling: bool, compression: str, precision: str, channels_last: bool, device: str,
                threads: int, plot: str | None, json_path: str | None) -> None:
    """Training samples/s on synthetic data, per process and in total."""
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model
    from hvdtrain.tools.bench import train
    from hvdtrain.tools.bench.stats import plot as draw

    not_stdout(plot, "plot")
    try:
        shape = tuple(int(part) for part in input_shape.split(","))
    except ValueError:
        raise UserError(f"--input-shape must be integers separated by commas, e.g. 3,32,32; got '{input_shape}'") from None
    for name, value in (("--batch-size", batch_size), ("--steps", steps), ("--repeats", repeats), ("--classes", classes - 1)):
        if value < 1:
            raise UserError(f"{name} must be at least {2 if name == '--classes' else 1}")
    net = build_model(ModelConfig(name=model, hidden=hidden), shape, classes)

    with command_engine(False, device=device, threads=threads) as engine:
        result = train.run(engine, net, shape, classes, batch_size=batch_size, warmup=warmup, steps=steps,
                           repeats=repeats, scaling=scaling, compression=compression, precision=precision,
                           channels_last=channels_last)
        if engine.is_root:
            report(train.describe(result), json_path, result)
            if plot:
                bars = {"total": [result["samples_per_s_total"]]}
                if scaling:
                    bars["ideal (N x one process)"] = [engine.size * result["single_process_samples_per_s"]]
                draw(plot, [engine.size], bars, xlabel="processes", ylabel="samples/s",
                     title=f"training throughput, batch {batch_size} per process")


@bench.command("sampler")
@click.option("--size", type=int, default=10**8, show_default=True, help="Samples in the data set.")
@click.option("--world-size", type=int, default=8, show_default=True)
@click.option("--json", "json_path", type=UserPath(dir_okay=False), help="Write the rows as JSON.")
def bench_sampler(size: int, world_size: int, json_path: str | None) -> None:
    """Time to the first index and extra memory: hvdtrain's sampler against DistributedSampler."""
    from hvdtrain.tools.bench import sampler

    if size < 1 or world_size < 1 or world_size > size:
        raise UserError(f"need 1 <= --world-size <= --size, got --size {size} --world-size {world_size}")
    rows = [sampler.measure(kind, size, world_size) for kind in sampler.SAMPLERS]
    report(sampler.table(rows, size, world_size), json_path, {"size": size, "world_size": world_size, "rows": rows})


@bench.command("data")
@fit_options
@click.option("--workers", "worker_list", help="Data-loader worker counts to time, comma-separated "
                                                "(default: 0, then 1, 2, 4, ... up to the cores this process has).")
@click.option("--batches", "count", type=int, default=50, show_default=True, help="Timed batches per worker count.")
@click.option("--steps", type=int, default=10, show_default=True, help="Timed training steps.")
@click.option("--json", "json_path", type=UserPath(dir_okay=False), help="Write the result as JSON.")
def bench_data(config_path: str | None, assignments: Sequence[str], debug: bool, worker_list: str | None, count: int,
               steps: int, json_path: str | None, **flags: Any) -> None:
    """Samples/s of the input pipeline alone per worker count, beside the training step's: whether a
    fit with these flags would wait for its data, and what to change."""
    from hvdtrain.tools.bench import data

    from hvdtrain.engine.environment import available_cores

    try:
        workers = ([int(part) for part in worker_list.split(",")] if worker_list else
                   [0, *(n for n in (1, 2, 4, 8, 16, 32) if n <= available_cores())])
    except ValueError:
        raise UserError(f"--workers must be integers separated by commas, e.g. 0,2,4; got '{worker_list}'") from None
    if min(workers) < 0 or count < 1 or steps < 1:
        raise UserError("--workers must be 0 or more, --batches and --steps at least 1")
    config = fit_config(config_path, assignments, flags)

    with command_engine(debug, kind=config.train.engine, device=config.train.device,
                        threads=config.train.threads) as engine:
        result = data.run(config, engine, workers, count, steps)
        if engine.is_root:  # dist: rank 0 reports its own shard's figures
            report(data.table(result), json_path, result)


@click.command()
@click.option("--np", "planned", type=int, default=1, show_default=True,
              help="Alone: the local processes you plan to start (for the GPU and thread plan).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--engine", "engine_kind", type=click.Choice(["auto", "horovod", "torch"]), default="auto",
              show_default=True, help="The engine to check; auto: alone, fail only if neither could run.")
@click.option("--json", "json_path", type=UserPath(dir_okay=False), help="Write every rank's facts as JSON.")
def doctor(planned: int, device: str, engine_kind: str, json_path: str | None) -> None:
    """Report versions, both engines (Horovod's build, torch.distributed's backends), MPI, GPUs and threads;
    exit 1 with a fix if a launch would fail."""
    from hvdtrain.engine import launcher_rank
    from hvdtrain.tools import doctor as checks

    if planned < 1:
        raise UserError(f"--np must be at least 1, got {planned}")
    if launcher_rank() is None:
        reports = [checks.report(0, 0, planned, planned, launched=False)]
    else:  # dist: every rank reports through the engine its launcher starts; rank 0 prints them in order
        with command_engine(False, kind=engine_kind, device="cpu", keep_freed_memory=False) as engine:
            mine = checks.report(engine.rank, engine.local_rank, engine.size, engine.local_size, launched=True,
                                 engine=engine.name)
            reports = engine.allgather_object(mine, "doctor")
        if not is_rank_0():
            return
    found = [checks.problems(r, device, engine_kind) for r in reports]
    report("\n".join(checks.render(r, f, device) for r, f in zip(reports, found)), json_path,
           [{**r, "problems": f} for r, f in zip(reports, found)])
    if any(found):
        sys.exit(1)


@click.command("config")
def show_config() -> None:
    """Print every config key with its default and meaning, as YAML."""
    click.echo(describe())

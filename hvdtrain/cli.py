"""The `hvdtrain` command: flags and YAML become one Config, then one call to `fit`.

    horovodrun -np 4 hvdtrain fit --config run.yaml --epochs 20
    hvdtrain config > run.yaml        # every key, its default and what it does
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import click

from hvdtrain.config import describe, load_config, parse_assignment
from hvdtrain.errors import UserError

# Flag name -> config key. Flags left out keep the YAML (or default) value.
FIT_FLAGS = {
    "data": "data.name", "batch_size": "data.batch_size", "model": "model.name", "task": "task.name",
    "optimizer": "optim.name", "lr": "optim.lr", "scale_lr": "optim.scale_lr",
    "warmup_epochs": "optim.warmup_epochs", "clip_grad_norm": "optim.clip_grad_norm",
    "epochs": "train.epochs", "seed": "train.seed", "accumulate": "train.accumulate",
    "compression": "train.compression", "adasum": "train.adasum", "device": "train.device",
    "threads": "train.threads", "precision": "train.precision", "channels_last": "train.channels_last",
    "compile": "train.compile", "nonfinite": "train.nonfinite", "num_workers": "data.num_workers", "run_dir": "run.dir", "resume": "run.resume",
    "overwrite": "run.overwrite", "progress": "run.progress", "elastic": "train.elastic",
    "log_every": "run.log_every", "tensorboard": "run.tensorboard", "horovod_timeline": "run.horovod_timeline",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hvdtrain")
def cli() -> None:
    """hvdtrain: data-parallel training with Horovod.

    Start one process per GPU or CPU slot with a launcher:

        horovodrun -np 4 hvdtrain fit
    """


def fit_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of `fit`, shared with `plan` (which shows what a fit with them would do)."""
    for option in reversed(_FIT_OPTIONS):
        function = option(function)
    return function


_FIT_OPTIONS = [
    click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file; flags override it."),
    click.option("--data", help="digits, random, FILE.npz or package.module:function."),
    click.option("--model", help="mlp, cnn or package.module:function."),
    click.option("--task", help="classification, regression, multilabel, language-model or package.module:function."),
    click.option("--epochs", type=int),
    click.option("--batch-size", type=int, help="Per process. dist: global batch = this x world size."),
    click.option("--lr", type=float, help="For one process; scaled by world size unless --no-scale-lr."),
    click.option("--optimizer", type=click.Choice(["sgd", "adamw"])),
    click.option("--scale-lr/--no-scale-lr", default=None, help="Scale lr by the global batch (default on)."),
    click.option("--warmup-epochs", type=float, help="Linear lr warmup length."),
    click.option("--clip-grad-norm", type=float, help="Clip the allreduced gradient norm."),
    click.option("--accumulate", type=int, help="Backward passes per optimizer step."),
    click.option("--compression", type=click.Choice(["none", "fp16"]), help="Gradient compression for the allreduce."),
    click.option("--adasum", is_flag=True, default=None, help="Adasum instead of averaging (MPI controller)."),
    click.option("--seed", type=int),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"])),
    click.option("--threads", type=int, help="Torch threads per process (0: cores / local processes)."),
    click.option("--precision", type=click.Choice(["32", "bf16", "fp16"]), help="fp16 adds a gradient scaler."),
    click.option("--channels-last", is_flag=True, default=None, help="Channels-last memory format for conv models."),
    click.option("--compile", is_flag=True, default=None, help="torch.compile the model."),
    click.option("--num-workers", type=int, help="DataLoader workers per process (-1: choose)."),
    click.option("--nonfinite", type=click.Choice(["error", "skip"]), help="On a NaN/Inf loss: stop, or skip the step."),
    click.option("--elastic", is_flag=True, default=None,
                 help="Elastic training (horovodrun --gloo --min-np M --host-discovery-script S)."),
    click.option("--run-dir", help="Run directory (default runs/fit-<date>-<time>)."),
    click.option("--resume", is_flag=True, default=None, help="Continue from the newest checkpoint in --run-dir."),
    click.option("--overwrite", is_flag=True, default=None, help="Start afresh in an existing --run-dir."),
    click.option("--progress", type=click.Choice(["auto", "bar", "off"]), help="Rank 0's progress bar."),
    click.option("--log-every", type=int, help="Also log to TensorBoard every N optimizer steps (0: per epoch)."),
    click.option("--tensorboard/--no-tensorboard", default=None, help="TensorBoard event files in the run directory (default on)."),
    click.option("--horovod-timeline", is_flag=True, default=None,
                 help="Record Horovod's timeline into RUN_DIR/horovod-timeline.json (open it in Perfetto)."),
    click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
                 help="Any config key, e.g. --set data.num_workers=2 (repeatable)."),
    click.option("--debug", is_flag=True, help="Show tracebacks for errors."),
]


@cli.command()
@fit_options
@click.option("--engine", type=click.Choice(["auto", "horovod", "torch", "local"]),
              help="Default: torch.distributed under torchrun, Horovod under horovodrun or mpirun.")
def fit(config_path: str | None, assignments: Sequence[str], engine: str | None, debug: bool, **flags: Any) -> None:
    """Train a model; under horovodrun or mpirun, on every process."""
    config = _fit_config(config_path, assignments, flags, engine)

    from hvdtrain.trainer import fit as run_fit  # torch and horovod load only when training

    _with_engine(debug, lambda engine: run_fit(config, engine), kind=config.train.engine,
                 device=config.train.device, threads=config.train.threads,
                 stall_timeout=config.train.stall_timeout, keep_freed_memory=config.train.keep_freed_memory,
                 timeline=config.run.horovod_timeline)


def _with_engine(debug: bool, work: Callable[[Any], Any], **engine_args: Any) -> None:
    """Starts the engine (`start_engine`'s arguments), runs `work(engine)`, shuts it down.

    A failure is reported before the engine shuts down: launchers stop the other ranks as
    soon as one exits, and rank 0 must have said why by then.
    """
    from hvdtrain.engine import start_engine

    engine = start_engine(**engine_args)
    try:
        work(engine)
    except Exception as err:
        _report_and_exit(err, debug)
        raise
    finally:
        engine.shutdown()


def _saved_run_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """What `evaluate`, `predict` and `export` share: which run, which checkpoint, which data."""
    for option in reversed([
        click.argument("run_dir", type=click.Path(file_okay=False)),
        click.option("--checkpoint", default="best", show_default=True, help="best, last or a checkpoint file."),
        click.option("--data", help="Another data set (as fit's --data); default: the run's own."),
        click.option("--split", "part", type=click.Choice(["val", "train", "all"]),
                     help="Which part of the data: fit's val or train split, or all of it in its own order "
                          "(default: val for the run's data, all for --data)."),
        click.option("--batch-size", type=int, help="Per process (default: the run's)."),
        click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
                     help="Any data or task config key, e.g. --set data.collate=pad (repeatable)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
        click.option("--debug", is_flag=True, help="Show tracebacks for errors."),
    ]):
        function = option(function)
    return function


def _run_overrides(data: str | None, batch_size: int | None, device: str, assignments: Sequence[str]) -> dict[str, Any]:
    overrides = dict(parse_assignment(text) for text in assignments)
    if data is not None:
        overrides["data.name"] = data
    if batch_size is not None:
        overrides["data.batch_size"] = batch_size
    overrides["train.device"] = device
    for key in ("run.resume", "run.overwrite", "train.elastic", "train.compile"):  # training only
        overrides[key] = False
    return overrides


def _default_part(part: str | None, data: str | None) -> str:
    return part or ("all" if data is not None else "val")


@cli.command()
@_saved_run_options
@click.option("--output", type=click.Path(dir_okay=False),
              help="JSON file for the metrics (default RUN_DIR/evaluate-<checkpoint>-<data>-<split>.json).")
def evaluate(run_dir: str, checkpoint: str, data: str | None, part: str | None, batch_size: int | None,
             assignments: Sequence[str], device: str, debug: bool, output: str | None) -> None:
    """A checkpoint's metrics on its validation data or other data (under a launcher: sharded)."""
    from hvdtrain.inference import evaluate_run
    from hvdtrain.saved_run import open_run

    overrides = _run_overrides(data, batch_size, device, assignments)
    part = _default_part(part, data)

    def work(engine: Any) -> None:
        saved = open_run(engine, run_dir, checkpoint, overrides)
        result = evaluate_run(saved, engine, part)
        if engine.is_root:  # dist: rank 0 reports and writes
            path = Path(output) if output else Path(run_dir) / f"evaluate-{_stem(checkpoint)}-{_stem(saved.config.data.name)}-{part}.json"
            _write_json(str(path), result)
            metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
            click.echo(f"hvdtrain: evaluated {saved.checkpoint} (epoch {saved.epoch}) on {result['samples']} samples "
                       f"of {result['data']} ({part}), world size {engine.size}: {metrics}; written to {path}")

    _with_engine(debug, work, device=device)


@cli.command()
@_saved_run_options
@click.option("--output", required=True, type=click.Path(dir_okay=False),
              help="File for the predictions: .npy, .pt or .jsonl (one per input sample, in input order).")
@click.option("--raw-outputs", is_flag=True, help="The model's raw outputs (logits) instead of the task's answer.")
def predict(run_dir: str, checkpoint: str, data: str | None, part: str | None, batch_size: int | None,
            assignments: Sequence[str], device: str, debug: bool, output: str, raw_outputs: bool) -> None:
    """Predictions for every sample, in the input's order, whatever the world size."""
    from hvdtrain.inference import check_prediction_path, predict_run, write_predictions
    from hvdtrain.saved_run import open_run

    path = check_prediction_path(output)
    overrides = _run_overrides(data, batch_size, device, assignments)
    part = _default_part(part, data)

    def work(engine: Any) -> None:
        saved = open_run(engine, run_dir, checkpoint, overrides)
        found = predict_run(saved, engine, part, raw_outputs)
        if found is not None:  # dist: rank 0 writes
            samples, shape = write_predictions(path, found)
            click.echo(f"hvdtrain: {samples} predictions ({shape}) of {saved.checkpoint} (epoch {saved.epoch}) "
                       f"on {saved.config.data.name} ({part}), world size {engine.size}, written to {path}")

    _with_engine(debug, work, device=device)


@cli.command("export")
@_saved_run_options
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torchscript", "pt2", "onnx"]),
              default="safetensors", show_default=True)
@click.option("--output", type=click.Path(dir_okay=False), help="File to write (default RUN_DIR/export/model.<format>).")
def export_model(run_dir: str, checkpoint: str, data: str | None, part: str | None, batch_size: int | None,
                 assignments: Sequence[str], device: str, debug: bool, fmt: str, output: str | None) -> None:
    """The model as safetensors, TorchScript, a torch.export program or ONNX, checked by loading it back."""
    from hvdtrain import export
    from hvdtrain.inference import first_batch, part_of
    from hvdtrain.saved_run import open_run

    overrides = _run_overrides(data, batch_size, device, assignments)
    part = _default_part(part, data)

    def work(engine: Any) -> None:
        saved = open_run(engine, run_dir, checkpoint, overrides)
        with engine.agree("export"):  # dist: rank 0 writes; a failure there stops every rank
            if engine.is_root:
                dataset, collate = part_of(saved, part, need_targets=False)
                batch = first_batch(dataset, saved.config.data.batch_size, collate, engine)
                path = Path(output) if output else export.default_path(saved, fmt)
                done = export.export(saved, fmt, path, batch)
                click.echo(f"hvdtrain: exported {saved.checkpoint} (epoch {saved.epoch}) as {fmt} to {done.path}; "
                           f"loaded back, its outputs on {done.samples} samples of {saved.config.data.name} ({part}) "
                           f"differ from the checkpoint's model by at most {done.max_abs_diff:.3g}")

    _with_engine(debug, work, device=device)


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--output", type=click.Path(dir_okay=False),
              help="PNG to write (default RUN_DIR/curves.png for one run, curves.png here for several).")
def plot(run_dirs: Sequence[str], output: str | None) -> None:
    """Loss and metrics against epoch and wall time; several runs overlaid."""
    from hvdtrain import plot as figure
    from hvdtrain.runs import read_run

    if not _is_rank_0():  # dist: under a launcher, rank 0 alone draws
        return

    runs = [read_run(Path(path)) for path in run_dirs]
    empty = [str(run.path) for run in runs if not run.epochs]
    if empty:
        raise UserError(f"nothing to plot in {', '.join(empty)}: no epoch finished there yet (metrics.jsonl is empty)")
    path = Path(output) if output else (runs[0].path / "curves.png" if len(runs) == 1 else Path("curves.png"))
    if path.suffix.lower() != ".png":
        raise UserError(f"--output '{path}' must end in .png")
    figure.draw(runs, path)
    click.echo(f"hvdtrain: wrote {path} ({', '.join(figure.panels(runs))} against epoch and wall time, "
               f"{len(runs)} run{'s' if len(runs) > 1 else ''})")


@cli.command("runs")
@click.argument("root", default="runs", type=click.Path(file_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the table as JSON.")
def list_runs(root: str, json_path: str | None) -> None:
    """A table of the runs under ROOT (default runs/): world size, epochs, best metric, speed, status."""
    from hvdtrain.runs import as_json, find_runs, table

    if not _is_rank_0():  # dist: under a launcher, rank 0 alone prints
        return

    found = find_runs(Path(root))
    if not found:
        raise UserError(f"no run directories under '{root}': runs are where `fit --run-dir` put them")
    click.echo(table(found))
    _write_json(json_path, as_json(found))


def _is_rank_0() -> bool:
    from hvdtrain.engine import launcher_rank

    return (launcher_rank() or 0) == 0


def _stem(name: str) -> str:
    """A short file-name-safe form of a checkpoint or data name."""
    text = name.rpartition(":")[2] if ":" in name and not name.endswith((".npz", ".pt")) else Path(name).stem
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "data"


def _fit_config(config_path: str | None, assignments: Sequence[str], flags: dict[str, Any], engine: str | None = None):
    overrides = dict(parse_assignment(text) for text in assignments)
    overrides.update({FIT_FLAGS[name]: value for name, value in flags.items() if value is not None})
    if engine is not None:
        overrides["train.engine"] = engine
    return load_config(config_path, overrides)


@cli.command()
@fit_options
@click.option("--np", "planned", type=int, default=1, show_default=True,
              help="Alone: plan for this many processes on this host (under a launcher: the launcher's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the plan as JSON.")
def plan(config_path: str | None, assignments: Sequence[str], debug: bool, planned: int, json_path: str | None,
         **flags: Any) -> None:
    """What each rank of `fit` with these flags will do: device, batch, steps, lr, first batch."""
    from hvdtrain import plan as planner
    from hvdtrain.engine import launcher_rank

    if planned < 1:
        raise UserError(f"--np must be at least 1, got {planned}")
    config = _fit_config(config_path, assignments, flags)
    if launcher_rank() is None:
        ranks = [planner.rank_facts(r, r, planned, planned, config.train.device, config.train.threads)
                 for r in range(planned)]
    else:  # dist: every rank reports its own device and threads; rank 0 prints the plan

        def work(engine: Any) -> None:
            mine = planner.rank_facts(engine.rank, engine.local_rank, engine.size, engine.local_size,
                                      config.train.device, config.train.threads, str(engine.device))
            ranks.extend(engine.allgather_object(mine, "plan"))

        ranks: list[dict[str, Any]] = []
        _with_engine(debug, work, device=config.train.device, threads=config.train.threads)
        if not _is_rank_0():
            return
    found = planner.make_plan(config, ranks)
    click.echo(planner.render(found))
    _write_json(json_path, found)


@cli.group()
def bench() -> None:
    """Measure: allreduce bandwidth, training throughput, sampler cost."""


def _engine_for_bench(device: str = "auto", threads: int = 0):
    from hvdtrain.engine import start_engine

    return start_engine("auto", device, threads)


def _write_json(path: str | None, payload: Any) -> None:
    if path:
        import json

        from hvdtrain.checkpoint import atomic_write

        text = json.dumps(payload, indent=2) + "\n"
        atomic_write(Path(path), lambda handle: handle.write(text.encode()))


@bench.command("allreduce")
@click.option("--min-bytes", type=int, default=4 << 10, show_default=True)
@click.option("--max-bytes", type=int, default=256 << 20, show_default=True)
@click.option("--iterations", type=int, default=5, show_default=True, help="Timed allreduces per size.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write bandwidth against size to this PNG.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows as JSON.")
def bench_allreduce(min_bytes: int, max_bytes: int, iterations: int, plot: str | None, json_path: str | None) -> None:
    """Allreduce time, algorithm and bus bandwidth from 4 KB to 256 MB (run under a launcher)."""
    from hvdtrain.bench import allreduce
    from hvdtrain.bench.stats import plot as draw

    if not 4 <= min_bytes <= max_bytes:
        raise UserError(f"--min-bytes must be at least 4 and at most --max-bytes, got {min_bytes} and {max_bytes}")
    engine = _engine_for_bench()
    try:
        rows = allreduce.run(engine, min_bytes, max_bytes, iterations)
        if engine.is_root:  # dist: rank 0 reports
            click.echo(allreduce.table(rows, engine))
            _write_json(json_path, {"world_size": engine.size, "controller": engine.controller, "rows": rows})
            if plot:
                draw(plot, [r["bytes"] for r in rows], {"algbw": [r["algbw_GBps"] for r in rows],
                                                         "busbw": [r["busbw_GBps"] for r in rows]},
                     xlabel="message size (bytes)", ylabel="GB/s", logx=True,
                     title=f"allreduce, {engine.size} processes, {engine.controller}")
    finally:
        engine.shutdown()


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
@click.option("--compression", type=click.Choice(["none", "fp16"]), default="none", show_default=True)
@click.option("--precision", type=click.Choice(["32", "bf16", "fp16"]), default="32", show_default=True)
@click.option("--channels-last", is_flag=True, help="Channels-last memory format for 4-d inputs.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=int, default=0, help="Torch threads per process (0: cores / local processes).")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write samples/s per round to this PNG.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the result as JSON.")
def bench_train(model: str, hidden: int, input_shape: str, classes: int, batch_size: int, warmup: int, steps: int,
                repeats: int, scaling: bool, compression: str, precision: str, channels_last: bool, device: str,
                threads: int, plot: str | None, json_path: str | None) -> None:
    """Training samples/s on synthetic data, per process and in total."""
    from hvdtrain.bench import train
    from hvdtrain.bench.stats import plot as draw
    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    try:
        shape = tuple(int(part) for part in input_shape.split(","))
    except ValueError:
        raise UserError(f"--input-shape must be integers separated by commas, e.g. 3,32,32; got '{input_shape}'") from None
    for name, value in (("--batch-size", batch_size), ("--steps", steps), ("--repeats", repeats), ("--classes", classes - 1)):
        if value < 1:
            raise UserError(f"{name} must be at least {2 if name == '--classes' else 1}")
    net = build_model(ModelConfig(name=model, hidden=hidden), shape, classes)
    engine = _engine_for_bench(device, threads)
    try:
        result = train.run(engine, net, shape, classes, batch_size=batch_size, warmup=warmup, steps=steps,
                           repeats=repeats, scaling=scaling, compression=compression, precision=precision,
                           channels_last=channels_last)
        if engine.is_root:
            click.echo(train.describe(result))
            _write_json(json_path, result)
            if plot:
                bars = {"total": [result["samples_per_s_total"]]}
                if scaling:
                    bars["ideal (N x one process)"] = [engine.size * result["single_process_samples_per_s"]]
                draw(plot, [engine.size], bars, xlabel="processes", ylabel="samples/s",
                     title=f"training throughput, batch {batch_size} per process")
    finally:
        engine.shutdown()


@bench.command("sampler")
@click.option("--size", type=int, default=10**8, show_default=True, help="Samples in the data set.")
@click.option("--world-size", type=int, default=8, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows as JSON.")
def bench_sampler(size: int, world_size: int, json_path: str | None) -> None:
    """Time to the first index and extra memory: hvdtrain's sampler against DistributedSampler."""
    from hvdtrain.bench import sampler

    if size < 1 or world_size < 1 or world_size > size:
        raise UserError(f"need 1 <= --world-size <= --size, got --size {size} --world-size {world_size}")
    rows = [sampler.measure(kind, size, world_size) for kind in sampler.SAMPLERS]
    click.echo(sampler.table(rows, size, world_size))
    _write_json(json_path, {"size": size, "world_size": world_size, "rows": rows})


@cli.command()
@click.option("--np", "planned", type=int, default=1, show_default=True,
              help="Alone: the local processes you plan to start (for the GPU and thread plan).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--engine", "engine_kind", type=click.Choice(["auto", "horovod", "torch"]), default="auto",
              show_default=True, help="The engine to check; auto: alone, fail only if neither could run.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every rank's facts as JSON.")
def doctor(planned: int, device: str, engine_kind: str, json_path: str | None) -> None:
    """Report versions, both engines (Horovod's build, torch.distributed's backends), MPI, GPUs and threads;
    exit 1 with a fix if a launch would fail."""
    from hvdtrain import doctor as checks
    from hvdtrain.engine import launcher_rank, start_engine

    if planned < 1:
        raise UserError(f"--np must be at least 1, got {planned}")
    if launcher_rank() is None:
        reports = [checks.report(0, 0, planned, planned, launched=False)]
    else:  # dist: every rank reports through the engine its launcher starts; rank 0 prints them in order
        engine = start_engine(engine_kind, "cpu", keep_freed_memory=False)
        try:
            mine = checks.report(engine.rank, engine.local_rank, engine.size, engine.local_size, launched=True,
                                 engine=engine.name)
            reports = engine.allgather_object(mine, "doctor")
        finally:
            engine.shutdown()
        if (launcher_rank() or 0) != 0:
            return
    found = [checks.problems(r, device, engine_kind) for r in reports]
    click.echo("\n".join(checks.render(r, f, device) for r, f in zip(reports, found)))
    _write_json(json_path, [{**r, "problems": f} for r, f in zip(reports, found)])
    if any(found):
        sys.exit(1)


@cli.command("config")
def show_config() -> None:
    """Print every config key with its default and meaning, as YAML."""
    click.echo(describe())


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: one clear line from rank 0 for bad input, tracebacks only with --debug."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        cli.main(args=args, prog_name="hvdtrain", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.exceptions.Abort:
        _fail("interrupted", 130, debug)
    except click.ClickException as err:
        _fail(err.format_message(), 2, debug)
    except Exception as err:
        _report_and_exit(err, debug)
        raise  # a bug or a machine failure: keep the traceback


def _report_and_exit(err: Exception, debug: bool) -> None:
    """Exits with one line for a user error or another rank's failure; returns for anything else."""
    from hvdtrain.engine import RankFailed, launcher_rank
    from hvdtrain.errors import FailedAt

    if isinstance(err, UserError):
        _fail(str(err), err.exit_code, debug)
    if isinstance(err, FailedAt):  # only the failing rank knows why: it says so itself
        _fail(str(err), err.exit_code, debug, every_rank=True)
    if isinstance(err, RankFailed):
        _fail(str(err), UserError.exit_code if err.kind == "UserError" else 1, debug)
    from hvdtrain.engine.horovod import is_collective_failure

    if is_collective_failure(err):
        # Not only rank 0: the rank that sees it says so (the others may be gone already).
        rank = launcher_rank() or 0
        first = str(err).split(". ")[0]
        _fail(f"rank {rank}: the job stopped in a collective: {first} (another rank failed or left: its own "
              "line, or the launcher's, names it)", 1, debug, every_rank=True)


def _fail(message: str, code: int, debug: bool, every_rank: bool = False) -> NoReturn:
    from hvdtrain.engine import launcher_rank

    if debug:
        traceback.print_exc()
    if every_rank or (launcher_rank() or 0) == 0:  # dist: one line from rank 0, not one per rank
        click.echo(f"hvdtrain: error: {message}", err=True)
    sys.exit(code)

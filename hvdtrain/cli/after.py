"""The commands for a finished run: `evaluate`, `predict` and `export` a checkpoint, `plot` its
curves, list the `runs`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import click

from hvdtrain.cli.common import UserPath, command_engine, is_rank_0, not_stdout, report
from hvdtrain.config import default_part, parse_assignment, saved_run_overrides
from hvdtrain.errors import UserError


def _saved_run_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """What `evaluate`, `predict` and `export` share: which run, which checkpoint, which data."""
    for option in reversed([
        click.argument("run_dir", type=UserPath(file_okay=False)),
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
    return saved_run_overrides(overrides, device)


def _default_part(part: str | None, data: str | None) -> str:
    return default_part(part, data is not None)


@click.command()
@_saved_run_options
@click.option("--output", type=UserPath(dir_okay=False),
              help="JSON file for the metrics (default RUN_DIR/evaluate-<checkpoint>-<data>-<split>.json; - for "
                   "stdout).")
def evaluate(run_dir: str, checkpoint: str, data: str | None, part: str | None, batch_size: int | None,
             assignments: Sequence[str], device: str, debug: bool, output: str | None) -> None:
    """A checkpoint's metrics on its validation data or other data (under a launcher: sharded)."""
    from hvdtrain.after.inference import evaluate_run
    from hvdtrain.after.saved_run import open_run

    overrides = _run_overrides(data, batch_size, device, assignments)
    part = _default_part(part, data)

    with command_engine(debug, device=device) as engine:
        saved = open_run(engine, run_dir, checkpoint, overrides)
        result = evaluate_run(saved, engine, part)
        if engine.is_root:  # dist: rank 0 reports and writes
            path = output or str(Path(run_dir) / f"evaluate-{_stem(checkpoint)}-{_stem(saved.config.data.name)}-{part}.json")
            metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
            report(f"hvdtrain: evaluated {saved.checkpoint} (epoch {saved.epoch}) on {result['samples']} samples of "
                   f"{result['data']} ({part}), world size {engine.size}: {metrics}; written to "
                   f"{'stdout' if path == '-' else path}", path, result)


@click.command()
@_saved_run_options
@click.option("--output", required=True, type=UserPath(dir_okay=False),
              help="File for the predictions: .npy, .pt or .jsonl (one per input sample, in input order).")
@click.option("--raw-outputs", is_flag=True, help="The model's raw outputs (logits) instead of the task's answer.")
def predict(run_dir: str, checkpoint: str, data: str | None, part: str | None, batch_size: int | None,
            assignments: Sequence[str], device: str, debug: bool, output: str, raw_outputs: bool) -> None:
    """Predictions for every sample, in the input's order, whatever the world size."""
    from hvdtrain.after.inference import check_prediction_path, predict_run, write_predictions
    from hvdtrain.after.saved_run import open_run

    path = check_prediction_path(output)
    overrides = _run_overrides(data, batch_size, device, assignments)
    part = _default_part(part, data)

    with command_engine(debug, device=device) as engine:
        saved = open_run(engine, run_dir, checkpoint, overrides)
        found = predict_run(saved, engine, part, raw_outputs)
        if found is not None:  # dist: rank 0 writes
            samples, shape = write_predictions(path, found)
            click.echo(f"hvdtrain: {samples} predictions ({shape}) of {saved.checkpoint} (epoch {saved.epoch}) "
                       f"on {saved.config.data.name} ({part}), world size {engine.size}, written to {path}")


@click.command("export")
@_saved_run_options
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torchscript", "pt2", "onnx"]),
              help="Default: the one --output's name says (model.onnx), else safetensors.")
@click.option("--output", type=UserPath(dir_okay=False), help="File to write (default RUN_DIR/export/model.<format>).")
def export_model(run_dir: str, checkpoint: str, data: str | None, part: str | None, batch_size: int | None,
                 assignments: Sequence[str], device: str, debug: bool, fmt: str | None, output: str | None) -> None:
    """The model as safetensors, TorchScript, a torch.export program or ONNX, checked by loading it back."""
    from hvdtrain.after import export
    from hvdtrain.after.inference import part_of
    from hvdtrain.data.loading import first_batch
    from hvdtrain.after.saved_run import open_run

    not_stdout(output, "model")
    fmt = export.format_for(fmt, output)
    overrides = _run_overrides(data, batch_size, device, assignments)
    part = _default_part(part, data)

    with command_engine(debug, device=device) as engine:
        saved = open_run(engine, run_dir, checkpoint, overrides)
        with engine.agree("export"):  # dist: rank 0 writes; a failure there stops every rank
            if engine.is_root:
                dataset, collate = part_of(saved, part, need_targets=False)
                batch = first_batch(dataset, saved.config.data.batch_size, collate, "export", engine.device)
                path = Path(output) if output else export.default_path(saved, fmt)
                done = export.export(saved, fmt, path, batch)
                click.echo(f"hvdtrain: exported {saved.checkpoint} (epoch {saved.epoch}) as {fmt} to {done.path}; "
                           f"loaded back, its outputs on {done.samples} samples of {saved.config.data.name} ({part}) "
                           f"differ from the checkpoint's model by at most {done.max_abs_diff:.3g}")


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=UserPath(file_okay=False))
@click.option("--output", type=UserPath(dir_okay=False),
              help="PNG to write (default RUN_DIR/curves.png for one run, curves.png here for several).")
def plot(run_dirs: Sequence[str], output: str | None) -> None:
    """Loss and metrics against epoch and wall time; several runs overlaid."""
    from hvdtrain.after import plot as figure
    from hvdtrain.after.runs import read_run

    if not is_rank_0():  # dist: under a launcher, rank 0 alone draws
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


@click.command("runs")
@click.argument("root", default="runs", type=UserPath(file_okay=False))
@click.option("--json", "json_path", type=UserPath(dir_okay=False), help="Also write the table as JSON.")
def list_runs(root: str, json_path: str | None) -> None:
    """A table of the runs under ROOT (default runs/): world size, epochs, best metric, speed, status."""
    from hvdtrain.after.runs import as_json, find_runs, table

    if not is_rank_0():  # dist: under a launcher, rank 0 alone prints
        return

    found = find_runs(Path(root))
    if not found:
        raise UserError(f"no run directories under '{root}': runs are where `fit --run-dir` put them")
    report(table(found), json_path, as_json(found))


def _stem(name: str) -> str:
    """A short file-name-safe form of a checkpoint or data name."""
    text = name.rpartition(":")[2] if ":" in name and not name.endswith((".npz", ".pt")) else Path(name).stem
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "data"

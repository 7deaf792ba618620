"""The `hvdtrain` command: flags and YAML become one Config, then one call to `fit`.

    horovodrun -np 4 hvdtrain fit --config run.yaml --epochs 20
    hvdtrain config > run.yaml        # every key, its default and what it does
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, NoReturn, Sequence

import click

from hvdtrain.config import describe, load_config, parse_assignment
from hvdtrain.errors import UserError

# Flag name -> config key. Flags left out keep the YAML (or default) value.
FIT_FLAGS = {
    "data": "data.name", "batch_size": "data.batch_size", "model": "model.name",
    "optimizer": "optim.name", "lr": "optim.lr", "scale_lr": "optim.scale_lr",
    "warmup_epochs": "optim.warmup_epochs", "clip_grad_norm": "optim.clip_grad_norm",
    "epochs": "train.epochs", "seed": "train.seed", "accumulate": "train.accumulate",
    "compression": "train.compression", "adasum": "train.adasum", "device": "train.device",
    "threads": "train.threads", "run_dir": "run.dir", "resume": "run.resume",
    "overwrite": "run.overwrite", "progress": "run.progress",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hvdtrain")
def cli() -> None:
    """hvdtrain: data-parallel training with Horovod.

    Start one process per GPU or CPU slot with a launcher:

        horovodrun -np 4 hvdtrain fit
    """


@cli.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file; flags override it.")
@click.option("--data", help="digits, random, FILE.npz or package.module:function.")
@click.option("--model", help="mlp, cnn or package.module:function.")
@click.option("--epochs", type=int)
@click.option("--batch-size", type=int, help="Per process. dist: global batch = this x world size.")
@click.option("--lr", type=float, help="For one process; scaled by world size unless --no-scale-lr.")
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]))
@click.option("--scale-lr/--no-scale-lr", default=None, help="Scale lr by the global batch (default on).")
@click.option("--warmup-epochs", type=float, help="Linear lr warmup length.")
@click.option("--clip-grad-norm", type=float, help="Clip the allreduced gradient norm.")
@click.option("--accumulate", type=int, help="Backward passes per optimizer step.")
@click.option("--compression", type=click.Choice(["none", "fp16"]), help="Gradient compression for the allreduce.")
@click.option("--adasum", is_flag=True, default=None, help="Adasum instead of averaging (MPI controller).")
@click.option("--seed", type=int)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--threads", type=int, help="Torch threads per process (0: cores / local processes).")
@click.option("--run-dir", help="Run directory (default runs/fit-<date>-<time>).")
@click.option("--resume", is_flag=True, default=None, help="Continue from the newest checkpoint in --run-dir.")
@click.option("--overwrite", is_flag=True, default=None, help="Start afresh in an existing --run-dir.")
@click.option("--progress", type=click.Choice(["auto", "bar", "off"]), help="Rank 0's progress bar.")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Any config key, e.g. --set data.num_workers=2 (repeatable).")
@click.option("--engine", type=click.Choice(["auto", "horovod", "local"]), help="Default: Horovod under a launcher.")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def fit(config_path: str | None, assignments: Sequence[str], engine: str | None, debug: bool, **flags: Any) -> None:
    """Train a model; under horovodrun or mpirun, on every process."""
    overrides = dict(parse_assignment(text) for text in assignments)
    overrides.update({FIT_FLAGS[name]: value for name, value in flags.items() if value is not None})
    if engine is not None:
        overrides["train.engine"] = engine
    config = load_config(config_path, overrides)

    from hvdtrain.engine import start_engine  # torch and horovod load only when training
    from hvdtrain.trainer import fit as run_fit

    run_engine = start_engine(config.train.engine, config.train.device, config.train.threads)
    try:
        run_fit(config, run_engine)
    except Exception as err:
        # Report before the engine shuts down: launchers stop the other ranks as soon
        # as one exits, and rank 0 must have said why by then.
        _report_and_exit(err, debug)
        raise
    finally:
        run_engine.shutdown()


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
    from hvdtrain.engine import RankFailed

    if isinstance(err, UserError):
        _fail(str(err), UserError.exit_code, debug)
    if isinstance(err, RankFailed):
        _fail(str(err), UserError.exit_code if err.kind == "UserError" else 1, debug)


def _fail(message: str, code: int, debug: bool) -> NoReturn:
    from hvdtrain.engine import launcher_rank

    if debug:
        traceback.print_exc()
    if (launcher_rank() or 0) == 0:  # dist: one line from rank 0, not one per rank
        click.echo(f"hvdtrain: error: {message}", err=True)
    sys.exit(code)

"""`hvdtrain fit` and `hvdtrain plan`: the fit flags, which become one Config, then one call.

    horovodrun -np 4 hvdtrain fit --config run.yaml --epochs 20
    hvdtrain plan --np 4 --batch-size 32      # what each rank of that fit would do
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import click

from hvdtrain.cli.common import is_rank_0, with_engine, write_json
from hvdtrain.config import parse_assignment, settings_config
from hvdtrain.errors import UserError

def fit_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of `fit`, shared with `plan` (which shows what a fit with them would do)."""
    for option in reversed(_FIT_OPTIONS):
        function = option(function)
    return function


_FIT_OPTIONS = [
    click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file; flags override it."),
    click.option("--data", help="digits, random, FILE.npz, a directory of .npy, FILE.bin (tokens), Hugging Face "
                                "data, tar shards (DIR, 'a-{000..009}.tar') or package.module:function."),
    click.option("--model", help="mlp, cnn or package.module:function."),
    click.option("--task", help="classification, regression, multilabel, language-model or package.module:function."),
    click.option("--epochs", type=int),
    click.option("--batch-size", type=int, help="Per process. dist: global batch = this x world size."),
    click.option("--lr", type=float, help="For one process's batch (optim.lr_batch); scaled by the global batch "
                                          "unless --no-scale-lr."),
    click.option("--optimizer", metavar="sgd|adamw|MODULE:FUNCTION",
                 help="sgd, adamw, or your own factory (given the model and lr, returning an optimizer)."),
    click.option("--scale-lr/--no-scale-lr", default=None, help="Scale lr by the global batch (default on)."),
    click.option("--warmup-epochs", type=float, help="Linear lr warmup length."),
    click.option("--schedule", type=click.Choice(["constant", "cosine", "linear", "step", "onecycle"]),
                 help="Learning-rate schedule after the warm-up (default constant)."),
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
    click.option("--resume", is_flag=False, flag_value="always", default=None, type=click.Choice(["always", "auto"]),
                 help="Continue from the newest checkpoint in --run-dir; `--resume auto`: continue if it has one, "
                      "else start there afresh."),
    click.option("--overwrite", is_flag=True, default=None, help="Start afresh in an existing --run-dir."),
    click.option("--checkpoint-every-steps", type=int, help="Also checkpoint every N optimizer steps inside an epoch."),
    click.option("--checkpoint-every-minutes", type=float, help="Also checkpoint inside an epoch every M minutes."),
    click.option("--stop-signals", metavar="SIGTERM,...",
                 help="Signals that stop every rank at one step with a checkpoint (exit 75); '' for none."),
    click.option("--progress", type=click.Choice(["auto", "bar", "off"]), help="Rank 0's progress bar."),
    click.option("--log-every", type=int, help="Also log to TensorBoard every N optimizer steps (0: per epoch)."),
    click.option("--tensorboard/--no-tensorboard", default=None, help="TensorBoard event files in the run directory (default on)."),
    click.option("--mlflow", is_flag=True, default=None,
                 help="Also log to MLflow ($MLFLOW_TRACKING_URI, else ./mlruns; pip install 'hvdtrain[mlflow]')."),
    click.option("--horovod-timeline", is_flag=True, default=None,
                 help="Record Horovod's timeline into RUN_DIR/horovod-timeline.json (open it in Perfetto)."),
    click.option("--callback", multiple=True, metavar="MODULE:CLASS",
                 help="Your callback (on_fit_start, on_step_end, on_epoch_end, on_checkpoint, on_fit_end); repeatable."),
    click.option("--sync-batchnorm", is_flag=True, default=None,
                 help="BatchNorm over the global batch (every rank's samples), not each rank's share."),
    click.option("--early-stopping-patience", type=int,
                 help="Stop every rank once the best metric has not improved for N epochs."),
    click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
                 help="Any config key, e.g. --set data.num_workers=2 (repeatable)."),
    click.option("--debug", is_flag=True, help="Show tracebacks for errors."),
]


@click.command()
@fit_options
@click.option("--engine", type=click.Choice(["auto", "horovod", "torch", "local"]),
              help="Default: torch.distributed under torchrun, Horovod under horovodrun or mpirun.")
def fit(config_path: str | None, assignments: Sequence[str], engine: str | None, debug: bool, **flags: Any) -> None:
    """Train a model; under horovodrun or mpirun, on every process."""
    from hvdtrain.train import early_signals

    early_signals.hold()  # a scheduler's signal while starting stops at the first step, not kills
    try:
        config = fit_config(config_path, assignments, flags, engine)

        from hvdtrain.train.fit import fit as run_fit  # torch and horovod load only when training

        with_engine(debug, lambda engine: run_fit(config, engine), kind=config.train.engine,
                     device=config.train.device, threads=config.train.threads,
                     stall_timeout=config.train.stall_timeout, keep_freed_memory=config.train.keep_freed_memory,
                     timeline=config.run.horovod_timeline)
    finally:
        early_signals.restore()


def fit_config(config_path: str | None, assignments: Sequence[str], flags: dict[str, Any], engine: str | None = None):
    return settings_config(config_path, dict(parse_assignment(text) for text in assignments), flags, engine)


@click.command()
@fit_options
@click.option("--np", "planned", type=int, default=1, show_default=True,
              help="Alone: plan for this many processes on this host (under a launcher: the launcher's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the plan as JSON.")
def plan(config_path: str | None, assignments: Sequence[str], debug: bool, planned: int, json_path: str | None,
         **flags: Any) -> None:
    """What each rank of `fit` with these flags will do: device, batch, steps, lr, first batch."""
    from hvdtrain.tools import plan as planner
    from hvdtrain.engine import launcher_rank

    if planned < 1:
        raise UserError(f"--np must be at least 1, got {planned}")
    config = fit_config(config_path, assignments, flags)
    if launcher_rank() is None:
        ranks = [planner.rank_facts(r, r, planned, planned, config.train.device, config.train.threads)
                 for r in range(planned)]
    else:  # dist: every rank reports its own device and threads; rank 0 prints the plan

        def work(engine: Any) -> None:
            mine = planner.rank_facts(engine.rank, engine.local_rank, engine.size, engine.local_size,
                                      config.train.device, config.train.threads, str(engine.device))
            ranks.extend(engine.allgather_object(mine, "plan"))

        ranks: list[dict[str, Any]] = []
        with_engine(debug, work, device=config.train.device, threads=config.train.threads)
        if not is_rank_0():
            return
    found = planner.make_plan(config, ranks)
    click.echo(planner.render(found))
    write_json(json_path, found)

"""`hvdtrain fit` and `hvdtrain plan`: the fit flags (built from config.FIT, the settings' one
table), which become one Config, then one call (`hvdtrain.api.fit_from`, as hvdtrain.fit's).

    horovodrun -np 4 hvdtrain fit --config run.yaml --epochs 20
    hvdtrain plan --np 4 --batch-size 32      # what each rank of that fit would do
"""

from __future__ import annotations

import os
import shlex
import typing
from typing import Any, Callable, Literal, Sequence

import click

from hvdtrain.cli.common import UserPath, command_engine, is_rank_0, report, report_and_exit
from hvdtrain.config import FIT, FitSetting, not_a_choice, parse_assignment, settings_config
from hvdtrain.errors import UserError


def fit_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of `fit`, shared with `plan` (which shows what a fit with them would do): the
    config file, each of fit's settings (config.FIT), `--set` and `--debug`."""
    options = [
        click.option("--config", "config_path", type=_ConfigFile(), help="YAML file; flags override it."),
        *(_setting_option(setting) for setting in FIT),
        click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
                     help="Any config key, e.g. --set data.num_workers=2 (repeatable)."),
        click.option("--debug", is_flag=True, help="Show tracebacks for errors."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _setting_option(setting: FitSetting) -> Callable[..., Any]:
    """A setting's flag, typed as its config field: choices for a field of a few values, `--x` for a
    switch that is off by default, `--x/--no-x` for one that is on; unset (None) unless given."""
    annotation, default = setting.field_type()
    if typing.get_origin(annotation) is typing.Union:  # Optional[X]: the flag takes an X
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    kwargs: dict[str, Any] = {"help": setting.help, "metavar": setting.metavar}
    if setting.repeatable:
        return click.option(setting.flag, multiple=True, **kwargs)
    kwargs["default"] = None
    if setting.alone is not None:
        kwargs.update(is_flag=False, flag_value=setting.alone, type=_Words(setting))
    elif annotation is bool:
        if default:
            return click.option(f"{setting.flag}/--no-{setting.flag[2:]}", **kwargs)
        kwargs["is_flag"] = True
    elif typing.get_origin(annotation) is Literal:
        kwargs["type"] = click.Choice([str(choice) for choice in typing.get_args(annotation)])
    elif annotation in (int, float):
        kwargs["type"] = annotation
    return click.option(setting.flag, **kwargs)


class _ConfigFile(UserPath):
    """A YAML file; a directory (a run's, given for its config.yaml) is one line naming the file meant."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        folder = os.path.expanduser(value) if isinstance(value, str) else value
        if isinstance(folder, str) and os.path.isdir(folder):
            recipe = os.path.join(folder, "config.yaml")
            raise UserError(f"--config takes a YAML file, and '{value}' is a directory" + (
                f": the run's recipe is {shlex.quote(recipe)} (to go on with that run instead: --run-dir "
                f"{shlex.quote(folder)} --resume)" if os.path.isfile(recipe) else ""))
        return super().convert(value, param, ctx)


class _Words(click.Choice):
    """The few words of a flag that may also stand alone (`--resume`, `--resume auto`); another value is
    one line saying what it takes, and for a path (another tool's habit), the run meant."""

    def __init__(self, setting: FitSetting) -> None:
        super().__init__(list(setting.choices))
        self.setting = setting

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value in self.choices:
            return value
        raise UserError(not_a_choice(self.setting, str(value), flag=True))


@click.command()
@fit_options
@click.option("--engine", type=click.Choice(["auto", "horovod", "torch", "local"]),
              help="Default: torch.distributed under torchrun, Horovod under horovodrun or mpirun.")
def fit(config_path: str | None, assignments: Sequence[str], engine: str | None, debug: bool, **flags: Any) -> None:
    """Train a model; under horovodrun or mpirun, on every process."""
    from hvdtrain.api import fit_from

    fit_from(lambda: fit_config(config_path, assignments, flags, engine), lambda err: report_and_exit(err, debug))


def fit_config(config_path: str | None, assignments: Sequence[str], flags: dict[str, Any], engine: str | None = None):
    return settings_config(config_path, dict(parse_assignment(text) for text in assignments), flags, engine)


@click.command()
@fit_options
@click.option("--np", "planned", type=int, default=1, show_default=True,
              help="Alone: plan for this many processes on this host (under a launcher: the launcher's).")
@click.option("--json", "json_path", type=UserPath(dir_okay=False), help="Also write the plan as JSON.")
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
        with command_engine(debug, device=config.train.device, threads=config.train.threads) as engine:
            mine = planner.rank_facts(engine.rank, engine.local_rank, engine.size, engine.local_size,
                                      config.train.device, config.train.threads, str(engine.device))
            ranks = engine.allgather_object(mine, "plan")
        if not is_rank_0():
            return
    found = planner.make_plan(config, ranks)
    report(planner.render(found), json_path, found)

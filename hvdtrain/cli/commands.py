"""The click group: every `hvdtrain` command, one module per command group (`fit`, `after`, `tools`,
`where`), what they share in `common`, the launcher wrappers in `launchers`."""

from __future__ import annotations

import click

from hvdtrain.cli import after, fit, tools, where


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hvdtrain")
def cli() -> None:
    """hvdtrain: data-parallel training with Horovod.

    Start one process per GPU or CPU slot with a launcher:

        horovodrun -np 4 hvdtrain fit
    """


for command in (fit.fit, fit.plan, after.evaluate, after.predict, after.export_model, after.plot, after.list_runs,
                tools.bench, tools.doctor, tools.show_config, where.where):
    cli.add_command(command)

"""The `hvdtrain` command: flags and YAML become one Config, then one call to `fit`.

    horovodrun -np 4 hvdtrain fit --config run.yaml --epochs 20
    hvdtrain config > run.yaml        # every key, its default and what it does

The entry point lives here, and imports next to nothing before `hvdtrain fit` holds a scheduler's
early signal (`early_signals`): Slurm's warning can come within the first second of a task, and until
then its default action kills it. The click group is in `commands`, one module per command group
(`fit`, `after`, `tools`), what they share in `common`, the launcher wrappers in `launchers`. A thin
shell: it may import anything of hvdtrain, lazily inside a command where the import is heavy.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn, Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: one clear line from rank 0 for bad input, tracebacks only with --debug. Without
    `argv`, the process's own command line: the process ends with the command."""
    if argv is None:
        sys.argv[1:] = _without_launch_s_local_rank(sys.argv[1:])
    else:
        argv = _without_launch_s_local_rank(list(argv))
    if argv is None:
        from hvdtrain.train import early_signals

        early_signals.in_the_command_s_process()
        if sys.argv[1:2] == ["fit"]:  # before click and the rest of hvdtrain load: fit_from keeps it held
            early_signals.hold()
            from hvdtrain import startup_gc

            startup_gc.hold()  # until the engine has started (running_engine)
        from hvdtrain.io.whole_lines import whole_lines

        whole_lines()
        if sys.argv[1:2] == ["fit"]:  # a run outlives its output's reader; `config | less` ends with it
            from hvdtrain.io.reader_gone import outlive_a_gone_reader

            outlive_a_gone_reader()
    code: int | str | None = 0
    try:
        _main(argv)
    except KeyboardInterrupt:  # before click runs the command
        _interrupted("--debug" in (sys.argv if argv is None else argv), argv is None)
    except SystemExit as leaving:
        if argv is not None and not _torch_engine_leaves():
            raise
        code = leaving.code
    except BaseException:  # a bug: its traceback, then the same way out
        if not _torch_engine_leaves():
            raise
        import traceback

        traceback.print_exc()
        code = 1
    # Outside the `except` blocks, as below: the exception's frames are let go first, and a data-loader
    # iterator held only by them ends its workers in order (leaving.py kills any a reference cycle keeps).
    _leave_torch_engine(code)
    if argv is None:
        _leave_without_teardown(code)
        sys.exit(code)


def _without_launch_s_local_rank(args: list[str]) -> list[str]:
    """torch.distributed.launch (without --use-env, its default) puts `--local-rank=N` before the
    command, `hvdtrain --local-rank=0 fit`; LOCAL_RANK, which it sets as well, says the same."""
    if args and re.fullmatch(r"--local[-_]rank=\d+", args[0]):
        return args[1:]
    return args


def _help_and_exit(text: str) -> NoReturn:
    """Usage on stderr (from rank 0 alone, under a launcher) and exit status 2, as click's own."""
    from hvdtrain.engine import launcher_rank

    if (launcher_rank() or 0) == 0:
        sys.stderr.write(f"{text}\n")
    sys.exit(2)


def _leave_without_teardown(code: int | str | None) -> None:
    """Outside the `except` above: the exception's traceback, and the frames it holds (a data-loader
    iterator of a run that stopped, whose workers exit with it), are freed first, as at a normal exit."""
    from hvdtrain.cli.leaving import leave_without_teardown  # not before fit holds its signals

    leave_without_teardown(code)


def _torch_engine_leaves() -> bool:
    engine = sys.modules.get("hvdtrain.engine.torch_distributed")
    return engine is not None and engine.leaves_at_once()


def _leave_torch_engine(code: int | str | None) -> None:
    """dist: a torch-engine rank leaves with os._exit, past the interpreter's teardown of the engine."""
    if _torch_engine_leaves():
        from hvdtrain.cli.leaving import leave_at_once

        leave_at_once(code)


def _main(argv: Sequence[str] | None) -> None:
    import click

    from hvdtrain.cli.commands import cli
    from hvdtrain.cli.common import fail, report_and_exit

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        cli.main(args=args, prog_name="hvdtrain", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.exceptions.Abort:  # click's KeyboardInterrupt
        _interrupted(debug, argv is None)
    except click.ClickException as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # `hvdtrain` alone (click 8.2 on): its help, not an error
            _help_and_exit(err.format_message())
        message = err.format_message()
        if "unexpected extra argument" in message and any(arg.endswith(".tar") for arg in args):
            message += "; a shell expanded a pattern of shards: quote it (--data 'shards/*.tar')"
        message = _launcher_s_option(err, message, args)
        fail(message, 2, debug)
    except Exception as err:
        report_and_exit(err, debug)
        raise  # a bug or a machine failure: keep the traceback


# The number of processes or devices, as launchers and other trainers take it: a launcher's option here.
_PROCESS_COUNT_OPTIONS = {"-np", "--np", "-n", "--num-proc", "--nproc-per-node", "--nproc_per_node", "--nnodes",
                          "--gpus", "--num-gpus", "--num_gpus", "--devices", "--world-size", "--world_size",
                          "--num-nodes", "--num_nodes", "--num-processes", "--num_processes"}


def _launcher_s_option(err: Exception, message: str, args: Sequence[str]) -> str:
    """`hvdtrain fit -np 2` (or Lightning's `--devices 2`): hvdtrain runs in each process a launcher
    starts, and the number of them is the launcher's; else `message` as it was."""
    option = getattr(err, "option_name", None)  # click's NoSuchOption: the option it could not place
    given = next((arg for arg in args if arg.split("=", 1)[0] in _PROCESS_COUNT_OPTIONS and
                  (arg.split("=", 1)[0] == option or arg.startswith(f"{option}p"))), None)  # -np is -n to click
    ctx = getattr(err, "ctx", None)
    command = getattr(getattr(ctx, "command", None), "name", None)
    if given is None or command not in ("fit", "evaluate", "predict"):
        return message
    flag, *value = given.split("=", 1)
    index = args.index(given)
    number = value[0] if value else args[index + 1] if index + 1 < len(args) else ""
    number = number if number.isdigit() else "N"
    return (f"hvdtrain {command} takes no {flag}: it runs in each process a launcher starts, and the number of "
            f"processes is the launcher's: horovodrun -np {number} hvdtrain {command} ..., or torchrun "
            f"--nproc-per-node {number} hvdtrain {command} ...")


def _interrupted(debug: bool, command_process: bool) -> NoReturn:
    """Ctrl-C (SIGINT, a user's or a launcher's) before training holds it or after it ended: one line
    from rank 0, status 130, at once. Imports nothing: the interrupt may have cut torch's own import
    short, and importing it again (for the rank) or the interpreter tearing it down at exit crashes,
    with a segfault or a traceback from every rank; so the command's own process leaves with _exit."""
    if debug:
        import traceback

        traceback.print_exc()
    if _rank_without_imports() in (None, 0):  # dist: one line, from rank 0
        print("hvdtrain: error: interrupted", file=sys.stderr, flush=True)
    if not command_process:
        sys.exit(130)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _rank_without_imports() -> int | None:
    """The engine's rank where it loaded whole, else the launchers' own variables."""
    engine = sys.modules.get("hvdtrain.engine")
    if engine is not None and hasattr(engine, "launcher_rank"):
        return engine.launcher_rank()
    names = ["HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]  # as engine.environment reads them
    if "TORCHELASTIC_RUN_ID" in os.environ:  # RANK means torchrun's only under torchrun
        names.insert(0, "RANK")
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "0") or 0) > 1:  # a step of several tasks, not a batch script
        names.append("SLURM_PROCID")
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def __getattr__(name: str) -> object:
    """`hvdtrain.cli.cli`, the click group (for click's CliRunner), loaded when asked for."""
    if name == "cli":
        from hvdtrain.cli.commands import cli

        return cli
    raise AttributeError(f"module 'hvdtrain.cli' has no attribute {name!r}")

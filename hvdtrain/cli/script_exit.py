"""A script's uncaught hvdtrain error ends its rank as the `hvdtrain` command would end it: bad input is
rank 0's one line and status 2, a stop on a signal rank 0's line and status 75, a rank stopped by
another's failure rank 0's note and status 76. Python's own way, a traceback and status 1 from every
rank, read as a failure of each: horovodrun named whichever rank exited first (a survivor, not the rank
that failed), and a stop with its checkpoint was no status 75 for a requeue script. A script that catches
them sees no change; an interactive session, which goes on after an error, neither (IPython shows its own
tracebacks). HVDTRAIN_DEBUG=1 shows the traceback too, as --debug does for the command."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Any, Iterator


@contextlib.contextmanager
def as_the_command_if_uncaught() -> Iterator[None]:
    """Around a call of the Python API: an hvdtrain error leaving it puts the hook in front of whatever
    hook is there by then (torch.distributed's, which writes its inner hook's output into a buffer it
    prints after, and mpi4py's abort), so that it answers first."""
    try:
        yield
    except Exception as err:
        if _is_hvdtrain_s(err):
            try:  # marked: the hook leaves errors of the same types the script raises itself to Python
                err.hvdtrain_left_the_api = True  # type: ignore[attr-defined]
            except AttributeError:  # one that takes no attributes keeps Python's way
                pass
            else:
                _install()
        raise


def _install() -> None:
    """Puts the hook in front of the one there is, unless it is there already."""
    before = sys.excepthook
    if getattr(before, "hvdtrain_script_exit", False):
        return

    def hook(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        interactive = hasattr(sys, "ps1") or sys.flags.interactive  # a session goes on after its error
        if interactive or not getattr(value, "hvdtrain_left_the_api", False):
            before(kind, value, trace)
            return
        try:
            _leave(_said_as_the_command(value))  # type: ignore[arg-type]
        except BaseException:  # Ctrl-C while a rank waits (for rank 0's word, the launcher, a thread): its status
            from hvdtrain.cli.leaving import flush_and_exit

            flush_and_exit(getattr(value, "exit_code", 1))

    hook.hvdtrain_script_exit = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _is_hvdtrain_s(err: Exception) -> bool:
    """An error the command ends on in its own way: bad input, a stop, another rank's failure."""
    from hvdtrain.errors import AnotherRankFailed, StoppedBySignal, UserError

    base = sys.modules.get("hvdtrain.engine.base")  # a RankFailed comes from a started engine only
    return isinstance(err, (AnotherRankFailed, StoppedBySignal, UserError, *((base.RankFailed,) if base else ())))


def _said_as_the_command(err: Exception) -> int:
    """Says what the command says of `err` (one the API marked) and returns its exit status.
    HVDTRAIN_DEBUG=1 is the script's --debug: the traceback first."""
    from hvdtrain.errors import ANOTHER_RANK_FAILED, AnotherRankFailed

    debug = os.environ.get("HVDTRAIN_DEBUG", "") not in ("", "0")
    if debug:
        traceback.print_exception(err)
    if isinstance(err, AnotherRankFailed):
        from hvdtrain.engine import launcher_rank
        from hvdtrain.train.survivors import note_and_wait

        note_and_wait(err, launcher_rank() or 0)
        return ANOTHER_RANK_FAILED
    from hvdtrain.cli.common import report_and_exit

    try:
        report_and_exit(err, debug=False)
    except SystemExit as leaving:
        return leaving.code if isinstance(leaving.code, int) else 1
    return 1  # report_and_exit exits on each of these; a status all the same


def _leave(code: int) -> None:
    """Exits with `code` as Python's own exit would, after its threads that are not daemons, but past
    the teardown (`leave_at_once`: the torch engine's can abort)."""
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    from hvdtrain.cli.leaving import leave_at_once

    leave_at_once(code)

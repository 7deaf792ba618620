"""The exception types for mistakes a user can fix, and where in their code one happened.

A `UserError` ends the run with one line from rank 0 and exit status 2; anything
else is a bug or a failure of the machine and keeps its traceback.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


# Where a line stands for a traceback: how to see it, from the command and from a script (cli/script_exit.py).
SHOWS_THE_TRACEBACK = "--debug, or HVDTRAIN_DEBUG=1 for a script, shows the traceback"


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""

    exit_code = 2


class TrainingStopped(UserError):
    """Training cannot go on (a non-finite loss, say): one line, exit status 1, checkpoints kept."""

    exit_code = 1


class RendezvousFailed(UserError):
    """The ranks could not meet (a port in use, an address that is not rank 0's host): one line from
    each rank that saw it, since rank 0 may not be the one. `others_wait`: this rank was to host the
    rendezvous and could not listen, so the others wait for it until their timeout."""

    def __init__(self, message: str, others_wait: bool = False):
        super().__init__(message)
        self.others_wait = others_wait


class StoppedBySignal(Exception):
    """Every rank stopped at the same step on a signal and a checkpoint was written: one line from
    rank 0 (not an error), exit status 75 (EX_TEMPFAIL: a requeue script tells it from a failure)."""

    exit_code = 75


# dist: the exit status of a rank whose collective broke off because another rank failed or left. Not
# a failure of its own: the launcher entries (cli/launchers.py) name the rank that failed, never one
# that exited with this (76, EX_PROTOCOL: its peer broke off the exchange).
ANOTHER_RANK_FAILED = 76


class AnotherRankFailed(Exception):
    """A script's `hvdtrain.fit` (or evaluate, predict, export) under a launcher: this rank's collective
    broke off because another rank failed or left. Not this rank's failure: that rank's own error, or its
    launcher's line, says why. The engine's error (HorovodInternalError, Gloo's) is its __cause__."""

    exit_code = ANOTHER_RANK_FAILED

    @classmethod
    def of(cls, err: BaseException) -> "AnotherRankFailed":
        """From the engine's error, with where the job stood (`note_where_the_job_stood`)."""
        position, resume = where_the_job_stood(err) or ("", "")
        return cls(f"the job stopped in a collective{f' ({position})' if position else ''}, as another rank "
                   f"failed or left (its own line, or the launcher's, names it){resume}")


class FailedAt(Exception):
    """The user's code (a Dataset, the model, the task) raised on this rank mid-run: one line from
    this rank naming where (after rank 0's own, where it failed alike), exit status 1. The original
    exception is its __cause__."""

    exit_code = 1


def note_where_the_job_stood(err: BaseException, position: str, resume: str = "", first: bool = False) -> None:
    """Keeps on a collective's error (its type unchanged: elastic training catches it by type), or on the
    user's, where this rank was when it broke off (`epoch 2, step 41`) and, on rank 0, `; ...` on the
    checkpoint to resume from. `first`: only if nothing was noted yet (the engine's own note, under a
    more exact one). An exception that takes no attributes (a frozen dataclass's) is left as it is."""
    if not (first and hasattr(err, "hvdtrain_where")):
        try:
            err.hvdtrain_where = (position, resume)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):  # dataclasses.FrozenInstanceError is an AttributeError
            pass


def where_the_job_stood(err: BaseException) -> tuple[str, str] | None:
    """(position, resume) as `note_where_the_job_stood` kept them; None where nothing was noted."""
    return getattr(err, "hvdtrain_where", None)


def message_lines(err: BaseException, count: int = 1) -> str:
    """The first `count` lines of an exception's message, joined into one line."""
    lines = str(err).strip().splitlines()
    return " ".join(line.strip() for line in lines[:count])


def users_code(failure: str, call: Callable[[], T], hint: Callable[[BaseException], str] = lambda err: "") -> T:
    """`call()`, where the user's code runs: its failure becomes one line, `failure: Type: message (file:line
    in function)` and `hint(err)` (what to do, from `; `); a UserError passes as it is."""
    try:
        return call()
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"{failure}: {type(err).__name__}: {message_lines(err)}{where(err)}{hint(err)}") from err


def where(err: BaseException) -> str:
    """` (file:line in function)` of the innermost frame in the user's own code; "" when none is. Of an
    exception a data-loader worker raised, the frame in the worker, from the traceback in its message
    (the traceback it is raised with again is the main process's, in PyTorch's loader)."""
    import re
    import traceback

    original = worker_traceback(err)
    if original is None:
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)]
    else:
        frames = [(name, int(line), function) for name, line, function in
                  re.findall(r'^\s*File "([^"]+)", line (\d+), in (\S+)', original, re.MULTILINE)]
    own = [frame for frame in frames if not library_file(frame[0])]
    return " ({}:{} in {})".format(*own[-1]) if own else ""


def worker_traceback(err: BaseException) -> str | None:
    """The traceback in a data-loader worker that raised `err`, as PyTorch's loader puts it in the message
    of the exception it raises again in the main process; None for any other exception."""
    text = str(err)
    if text.startswith("Caught ") and "Original Traceback" in text:
        return text.split("Original Traceback", 1)[1]
    return None


def library_file(filename: str) -> bool:
    """hvdtrain's own files, the standard library's, installed packages' (torch, Horovod) and their
    command scripts (bin/hvdtrain)."""
    import sysconfig
    from pathlib import Path

    if filename.startswith("<"):  # frozen modules (<frozen runpy>)
        return True
    paths = sysconfig.get_paths()
    roots = [Path(__file__).parent, *(Path(paths[key]) for key in ("stdlib", "purelib", "platlib", "scripts"))]
    return any(root in Path(filename).parents for root in roots)

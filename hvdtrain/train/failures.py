"""A failure in the middle of a run, as each rank says it: the rank that met it names where in the run
and where in the user's code (an exception a data-loader worker raised, by its own message, not its
traceback). A rank whose collective broke off because of it: train/survivors.py."""

from __future__ import annotations

import re
from pathlib import Path

from hvdtrain.data.loading import batching_hint
from hvdtrain.engine import Engine, RankFailed
from hvdtrain.errors import (SHOWS_THE_TRACEBACK, FailedAt, StoppedBySignal, UserError, message_lines,
                             note_where_the_job_stood, where, worker_traceback)
from hvdtrain.train.callbacks import StoppedEarly


def located(err: Exception, engine: Engine, position: str, newest: Path | None = None) -> Exception:
    """The user's code failed mid-run on this rank (a Dataset, the model, the task): one line naming the
    rank, where in the run, where in their code, and on rank 0 the newest checkpoint (`newest`, last.pt).
    A collective that broke off passes as it is (elastic training catches it by type), carrying where
    the job stood; other failures pass as they are."""
    if engine.is_engine_signal(err):
        note_where_the_job_stood(err, position, _resume_from(newest if engine.is_root else None))
        return err
    if isinstance(err, (RankFailed, StoppedBySignal, StoppedEarly, FailedAt)):
        return err
    note_where_the_job_stood(err, position, first=True)  # for the run directory's note (`hvdtrain runs`)
    message = worker_message(err)
    killed = re.search(r"DataLoader worker \(pid[^)]*\) is killed by signal: (\w+)", f"{message} {err.__cause__}")
    if killed and killed.group(1) in ("Terminated", "Interrupt", "Hangup"):  # not the user's code
        located: Exception = FailedAt(f"rank {engine.rank} stopped at {position}: its data-loader worker was ended by "
                                      f"a signal ({killed.group(1)}), as a launcher stopping the job or a scheduler "
                                      "sends it; another rank's line says why, if one failed")
    elif killed:
        located = FailedAt(f"rank {engine.rank} failed at {position}: a data-loader worker was killed ({killed.group(1)}: "
                           "often the kernel's out-of-memory killer); lower data.num_workers or data.shuffle_buffer")
    elif isinstance(err, UserError) and (engine.is_root or type(err) is not UserError):
        if message == str(err):  # rank 0's own, or one every rank stops with together (TrainingStopped)
            return err
        located = type(err)(message)  # a data-loader worker's, without its traceback
    elif isinstance(err, UserError):  # bad data met mid-run on this rank: it says so itself
        located = FailedAt(f"rank {engine.rank} failed at {position}: {message}")
        located.exit_code = UserError.exit_code  # type: ignore[attr-defined]
    else:
        resume = _resume_from(newest if engine.is_root else None)
        located = FailedAt(f"rank {engine.rank} failed at {position}: {type(err).__name__}: {message}{where(err)}"
                           f"{batching_hint(err)}; every rank stops ({SHOWS_THE_TRACEBACK}){resume}")
    located.__cause__ = err
    note_where_the_job_stood(located, position)
    return located


def worker_message(err: Exception) -> str:
    """The first line of the message; of an exception a data-loader worker raised (which PyTorch raises
    again with the worker's traceback as its message), the worker's own message."""
    original = worker_traceback(err)
    if original is not None:
        last = original.strip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return message_lines(err)


def _resume_from(newest: Path | None) -> str:
    """`; ... --resume` naming the newest checkpoint; "" where it is not known here."""
    if newest is None:
        return ""
    if not newest.exists():
        return "; no checkpoint was written yet"
    return f"; the newest checkpoint is {newest}: continue with --resume"

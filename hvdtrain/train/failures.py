"""A failure in the middle of a run, as the rank that met it says it: where in the run, and where in
the user's code; an exception a data-loader worker raised, by its own message, not its traceback."""

from __future__ import annotations

import re

from hvdtrain.engine import Engine, RankFailed
from hvdtrain.errors import FailedAt, StoppedBySignal, UserError, message_lines, where
from hvdtrain.train.callbacks import StoppedEarly


def located(err: Exception, engine: Engine, position: str) -> Exception:
    """The user's code failed mid-run on this rank (a Dataset, the model, the task): one line
    naming the rank, where in the run, and where in their code. Other failures pass as they are."""
    if isinstance(err, (RankFailed, StoppedBySignal, StoppedEarly, FailedAt)) or engine.is_engine_signal(err):
        return err
    message = worker_message(err)
    killed = re.search(r"DataLoader worker \(pid[^)]*\) is killed by signal: (\w+)", message)
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
        located = FailedAt(f"rank {engine.rank} failed at {position}: {message}", after_rank_0=True)
        located.exit_code = UserError.exit_code  # type: ignore[attr-defined]
    else:
        located = FailedAt(f"rank {engine.rank} failed at {position}: {type(err).__name__}: {message}{where(err)}; "
                           "every rank stops (--debug shows the traceback)")
    located.__cause__ = err
    return located


def worker_message(err: Exception) -> str:
    """The first line of the message; of an exception a data-loader worker raised (which PyTorch raises
    again with the worker's traceback as its message), the worker's own message."""
    text = str(err)
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = text.strip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return message_lines(err)

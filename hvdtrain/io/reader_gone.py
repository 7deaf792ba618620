"""When whoever reads `hvdtrain fit`'s output goes away, the run goes on without printing.

`hvdtrain fit | head`, a `| tee log` ended by the same Ctrl-C that stops the run, a terminal closed
under a job: the next line printed meets EPIPE (EIO from a hung-up terminal). click ends a command at
EPIPE with status 1 and not a word, so a run died there, before its next checkpoint, and a stop on a
signal ended with 1, not 75; ranks under mpirun went on, as mpirun keeps reading. So the stream that
fails is pointed at /dev/null and the run goes on; where stdout went, one line on stderr says so.
The fit command's own process only: a script's streams are the script's.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import Any, TextIO

_GONE = (errno.EPIPE, errno.EIO)


def outlive_a_gone_reader() -> None:
    """Replaces sys.stdout and sys.stderr with streams that outlive their reader."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue  # no descriptor (closed, or a stream someone replaced): nothing to point elsewhere
        if not isinstance(stream, _Outliving):
            setattr(sys, name, _Outliving(stream, name))


class _Outliving:
    """A text stream whose writes, once its reader has gone, go to /dev/null. Everything else is the
    stream's own (fileno, isatty, encoding, reconfigure)."""

    def __init__(self, stream: TextIO, name: str):
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._discard_from_now_on(err)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._discard_from_now_on(err)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _discard_from_now_on(self, err: OSError) -> None:
        if err.errno not in _GONE or (err.errno == errno.EIO and not _a_terminal(self._stream.fileno())):
            raise err  # EIO from a file is the disk's failure, not a reader gone
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())  # C++ writes to the descriptor (torch's, MPI's) too
        finally:
            os.close(null)
        try:
            self._stream.flush()  # the text the failed write left buffered, into /dev/null
        except OSError:
            pass
        if self._name == "stdout":
            reader = "a closed pipe" if err.errno == errno.EPIPE else "a terminal that hung up"
            sys.stderr.write(f"hvdtrain: standard output's reader has gone ({reader}): the run goes on "
                             "without printing; its epoch lines are kept in its metrics.jsonl\n")
            sys.stderr.flush()


def _a_terminal(fd: int) -> bool:
    """A character device: a terminal that hung up no longer says it is one (isatty)."""
    try:
        return stat.S_ISCHR(os.fstat(fd).st_mode)
    except OSError:
        return False

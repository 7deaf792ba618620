"""Each line the `hvdtrain` command's process prints leaves it in one write (up to the buffer's 8 KiB).

Launchers read each rank's output as it comes and tag every piece they read (`[1,0]<stdout>:`).
horovodrun runs its ranks with PYTHONUNBUFFERED=1, where print's text and its newline are two writes:
a line then reads `...7.3s[1,0]<stdout>:` followed by an empty tagged line. Line buffering keeps them
one write, and still hands each line to the launcher as soon as it ends. The `hvdtrain` command's own
process only: a script's streams are the script's (`progress.say` writes each of fit's lines once).
"""

from __future__ import annotations

import io
import sys


def whole_lines() -> None:
    """Line-buffers this process's stdout and stderr where they write through (PYTHONUNBUFFERED)."""
    for stream in (sys.stdout, sys.stderr):
        if not getattr(stream, "write_through", False):
            continue  # buffered already: print's flush, or stderr's line buffering, writes the line once
        try:
            stream.reconfigure(write_through=False, line_buffering=True)
        except (AttributeError, ValueError, io.UnsupportedOperation):
            pass  # a stream someone replaced (a notebook's, a test's capture): theirs to buffer

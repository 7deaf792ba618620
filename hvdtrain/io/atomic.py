"""Files that are either whole or absent: written beside their place, synced, renamed into it.
Used by checkpoints, the run directory's config, metrics and summary, predictions and JSON reports."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Any) -> None:
    """Calls `write(file)` on a temporary file beside `path`, then renames it into place.

    A crash at any moment leaves either the old file or the new one, never a part.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, shared_file_mode())  # mkstemp makes files private; others on a cluster read runs
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def shared_file_mode() -> int:
    """The mode a new file gets from the process's umask (0o644 under the usual 022). Read, not set
    and restored: the umask is the whole process's, and a checkpoint is written beside other threads
    that create files."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:  # not Linux, or no /proc
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

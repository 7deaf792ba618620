"""Rank 0's claim on its run directory for as long as its fit runs: a second job started on the same
directory (`--overwrite` or `--resume` in another terminal, a script run twice) is refused in one
line instead of writing the same checkpoints and metrics at once. An advisory lock (flock) on a file
in the directory: the kernel lets it go when the process ends however it ends, so a killed job
leaves no stale claim, and a shared file system's lock manager carries it across hosts."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from hvdtrain.errors import UserError

LOCK_FILE = ".hvdtrain.lock"

_held: dict[Path, int] = {}  # run directory (resolved) -> the open lock file this process holds


def claim(run_dir: Path) -> None:
    """Takes the run directory for this process; raises UserError while another process holds it.
    This process's own earlier claim on it (a fit before, in a script) is let go first. Where the
    file system has no locks, nothing is claimed."""
    key = run_dir.resolve()
    release(run_dir)
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # a directory this process cannot write: its first write says so
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another job is running in run directory '{run_dir}': wait for it or stop it, or choose "
                        "another --run-dir") from None
    except OSError:  # no locks on this file system
        os.close(fd)
        return
    _held[key] = fd


def release(run_dir: Path) -> None:
    """Lets the run directory go (the fit in it has ended)."""
    fd = _held.pop(run_dir.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the lock's only descriptor here unlocks it

"""Rank 0's claim on its run directory for as long as its fit runs: a second job started on the same
directory (`--overwrite` or `--resume` in another terminal, a script run twice) is refused in one
line instead of writing the same checkpoints and metrics at once. An advisory lock (flock) on a file
in the directory, which names its holder: the kernel lets it go when the process ends, however it
ends, so a killed job leaves no stale claim; a shared file system's lock manager carries it across
hosts (and may keep a crashed host's for a while: a requeued Slurm job then takes over its own)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from hvdtrain.errors import UserError

LOCK_FILE = ".hvdtrain.lock"

_held: dict[Path, int] = {}  # run directory (resolved) -> the open lock file this process holds


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) shares the lock with this process and would keep it past
    this process's end: it lets its copy go."""
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def claim(run_dir: Path) -> None:
    """Takes the run directory for this process; raises UserError while another process holds it.
    This process's own earlier claim on it (a fit before, in a script) is let go first. Where the
    file system has no locks, nothing is claimed."""
    key = run_dir.resolve()
    release_all()  # one fit at a time in a process: an earlier fit's claim has ended
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # a directory this process cannot write: its first write says so
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        if _own_job_s_last_allocation(holder):
            sys.stderr.write(f"hvdtrain: warning: run directory '{run_dir}' is still locked for this Slurm job's "
                             f"last allocation ({_who(holder)}), whose host the file system has not let go of yet: "
                             "going on without the lock\n")
            return
        raise UserError(f"another job is running in run directory '{run_dir}' ({_who(holder)}): wait for it or stop "
                        "it, or choose another --run-dir") from None
    except OSError:  # no locks on this file system
        os.close(fd)
        return
    _held[key] = fd
    facts = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(facts).encode(), 0)
    except OSError:
        pass  # the lock holds without its note


def release_all() -> None:
    """Lets every run directory this process holds go (its fit has ended)."""
    for fd in _held.values():
        os.close(fd)  # the lock's last descriptor (forked children closed theirs): unlocked
    _held.clear()


def _holder(fd: int) -> dict:
    try:
        facts = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def _who(holder: dict) -> str:
    if not holder.get("host"):
        return "its holder unknown"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"process {holder.get('pid')} on {holder['host']}{job}"


def _own_job_s_last_allocation(holder: dict) -> bool:
    """The holder is this Slurm job before its requeue (the job runs again only once its last
    allocation has ended): a crashed node's lock that the file system still keeps."""
    job = os.environ.get("SLURM_JOB_ID")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return bool(job) and holder.get("slurm_job") == job and restarts.isdigit() and int(restarts) > 0

"""Rank 0's claim on its run directory for as long as its fit runs: a second job started on the same
directory (`--overwrite` or `--resume` in another terminal, a script run twice) is refused in one
line instead of writing the same checkpoints and metrics at once. An advisory lock (flock) on a file
in the directory, which names its holder: the kernel lets it go when the process ends, however it
ends, so a killed job leaves no stale claim; a shared file system's lock manager carries it across
hosts (and may keep a crashed host's for a while: a requeued Slurm job then takes over its own)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from hvdtrain.errors import UserError

LOCK_FILE = ".hvdtrain.lock"
GLANCE_SECONDS = 1.0  # how long a claim waits out another process's glance at the lock (`glance`)

_held: dict[Path, int] = {}  # run directory (resolved) -> the open lock file this process holds
_notes: dict[Path, bytes] = {}  # run directory (resolved) -> its lock's note before this process's claim
KEEP_THE_NOTE = {"ended": None}  # `release`'s: the fit changed nothing there (refused before it trained)
# Held across a fork too: a child never sees a claim half made or let go. Re-entrant: `note_ending` may come
# from a signal handler on a thread inside `claim` or `release`.
_guard = threading.RLock()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) shares the lock with this process and would keep it past
    this process's end: it lets its copies go."""
    global _guard
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _guard = threading.Lock()


os.register_at_fork(before=lambda: _guard.acquire(), after_in_parent=lambda: _guard.release(),
                    after_in_child=_forget_in_child)


def key(run_dir: Path) -> Path:
    """What names a run directory's claim: its resolved path (taken before any chdir of a fit)."""
    return run_dir.resolve()


def claim(run_dir: Path) -> Path | None:
    """Takes the run directory for this process and returns the key that `release` takes; raises
    UserError while another process holds it. This process's own earlier claim on it (a fit before,
    in a script) is let go first. Where the file system has no locks, nothing is claimed (None)."""
    claimed = key(run_dir)
    release(claimed)
    with _guard:
        fd = _open(run_dir / LOCK_FILE)
        if fd is None:
            return None
        try:
            _lock_unless_held(fd)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if _own_job_s_last_allocation(holder):
                sys.stderr.write(f"hvdtrain: warning: run directory '{run_dir}' is still locked for this Slurm job's "
                                 f"last allocation ({_who(holder)}), whose host the file system has not let go of "
                                 "yet: going on without the lock\n")
                return None
            raise _another_job(run_dir, holder) from None
        except OSError:  # no locks on this file system
            os.close(fd)
            return None
        _held[claimed] = fd
        _notes[claimed] = _note_of(fd)
    facts = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
             "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0")}
    _write_note(fd, json.dumps(facts).encode(), sync=True)  # the lock holds without its note
    return claimed


def check_free(run_dir: Path) -> None:
    """claim's refusal, with nothing claimed: UserError where another job holds the run directory now."""
    if key(run_dir) in _held:  # this process's own claim (a fit before, in a script): claim lets it go
        return
    held, holder = glance(run_dir)
    if held and not _own_job_s_last_allocation(holder):
        raise _another_job(run_dir, holder)


def _another_job(run_dir: Path, holder: dict) -> UserError:
    return UserError(f"another job is running in run directory '{run_dir}' ({_who(holder)}): wait for it or "
                     "stop it, or choose another --run-dir")


def _lock_unless_held(fd: int) -> None:
    """The lock, else BlockingIOError; a moment's shared hold (`glance`, from `hvdtrain runs`) is waited out."""
    deadline = time.monotonic() + GLANCE_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def glance(run_dir: Path) -> tuple[bool, dict]:
    """Whether a fit holds the run directory now, and the lock's note: its holder's facts while it does; once
    none does, how the last one ended where it did not finish (`release`), or the facts of one that ended
    without letting go (killed, its host lost), or {}. The kernel's answer, not the note's: a glance."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False, {}
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True, _holder(fd)
    except OSError:  # no locks on this file system
        return False, {}
    else:
        return False, _holder(fd)
    finally:
        os.close(fd)  # lets a shared hold go at once


def release(claimed: Path | None, ended: dict | None = None) -> None:
    """Lets the run directory of `claim`'s key go (its fit has ended). `ended`: how, where it did not finish
    ({"ended": "failed", ...}), the lock's note for `hvdtrain runs`; KEEP_THE_NOTE: the note there was
    before the claim (how the last fit that trained ended); else the note goes."""
    with _guard:
        fd = _held.pop(claimed, None) if claimed is not None else None
        before = _notes.pop(claimed, b"") if claimed is not None else b""
        if fd is not None:
            # No note of a holder that has gone: how it ended, or the note before it, or none.
            _write_note(fd, before if ended is KEEP_THE_NOTE else json.dumps(ended).encode() if ended else b"")
            os.close(fd)  # the lock's last descriptor (forked children closed theirs): unlocked


def note_ending(ended: dict) -> None:
    """How this process's fit ends, written into each lock it holds now, for a process about to end without
    unwinding (a stall, a second signal): `release` would not run to write it."""
    if not _guard.acquire(timeout=1.0):  # a claim or release under way: no descriptor that may be closed now
        return
    try:
        for fd in list(_held.values()):
            _write_note(fd, json.dumps(ended).encode())
    finally:
        _guard.release()


def _open(path: Path) -> int | None:
    """The lock file, made if need be; read-only where it is another user's (flock needs no more)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    except PermissionError:
        with contextlib.suppress(OSError):
            return os.open(path, os.O_RDONLY)
    except OSError:
        pass
    sys.stderr.write(f"hvdtrain: warning: cannot open {path}: this run does not lock its run directory\n")
    return None


def _write_note(fd: int, note: bytes, sync: bool = False) -> None:
    """The lock file's note replaced (`sync`: a shared file system's other hosts read it now, not after the
    client's cache); a note that cannot be written is left out."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, note, 0)
        if sync:
            os.fsync(fd)


def _note_of(fd: int) -> bytes:
    try:
        return os.pread(fd, 4096, 0)
    except OSError:
        return b""


def _holder(fd: int) -> dict:
    try:
        facts = json.loads(_note_of(fd) or b"{}")
    except ValueError:
        return {}
    return facts if isinstance(facts, dict) else {}


def _who(holder: dict) -> str:
    if not holder.get("host"):
        return "its holder unknown"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"process {holder.get('pid')} on {holder['host']}{job}"


def _own_job_s_last_allocation(holder: dict) -> bool:
    """The holder is this Slurm job in an earlier allocation (the job runs again only once that one
    has ended): a crashed node's lock that the file system still keeps. Not another step of this
    allocation, which holds the same job id and restart count."""
    job, restarts, held_in = (os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0"),
                              str(holder.get("slurm_restart", "")))
    return bool(job) and holder.get("slurm_job") == job and restarts.isdigit() and held_in.isdigit() and \
        int(held_in) < int(restarts)

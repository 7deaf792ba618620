"""Files that are either whole or absent: written beside their place, synced, renamed into it.
Used by checkpoints, the run directory's config, metrics and summary, predictions and JSON reports."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hvdtrain.errors import UserError
from hvdtrain.io.progress import mib


class WriteFailed(UserError):
    """A file that could not be written: a full disk or quota, a read-only or vanished directory.
    One line, not a traceback: the machine's state, which the user fixes. `reason` is the line's cause."""

    def __init__(self, path: Path, reason: str, failed: str = "could not write"):
        super().__init__(f"{failed} {path}: {reason}")
        self.reason = reason

    @classmethod
    def of(cls, path: Path, err: OSError, failed: str = "could not write",
           directory: Path | None = None) -> "WriteFailed":
        """For an OSError met writing `path`: its reason, with the free space of `directory` (`path`'s own)
        where the disk is full."""
        return cls(path, why_not_written(err, directory or path.parent) or str(err), failed)


# How torch.save's archive writer words a write that failed (inline_container.cc).
_TORCH_WRITER_FAILED = ("unexpected pos", "PytorchStreamWriter failed")
# np.save's words for a write that came up short ("1797 requested and 496 written").
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")
# The system's words for a full disk, as other libraries' errors (safetensors', say) pass them on.
_FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def why_not_written(err: Exception, directory: Path) -> str | None:
    """What a failed write's error says, with the free space where that ran out; None for an error that
    is not a failed write. torch.save into a file swallows the write's OSError and says only
    `unexpected pos N vs M`: a short write, which a full file system (or quota) is nearly always behind."""
    if isinstance(err, OSError) and err.errno == errno.ENOENT and not directory.exists():
        return f"its directory {directory} no longer exists (removed while the job ran?)"
    if isinstance(err, OSError) and (err.errno is not None or _SHORT_WRITE.search(str(err))):
        full = err.errno in (errno.ENOSPC, errno.EDQUOT, None)  # np.save's short write has no errno
        reason = err.strerror or str(err)
    elif isinstance(err, RuntimeError) and any(words in str(err) for words in _TORCH_WRITER_FAILED):
        full, reason = True, "the file came out shorter than written: no space left on the device or over a quota"
    elif any(words in str(err) for words in _FULL):
        full, reason = True, next(words for words in _FULL if words in str(err))
    else:
        return None
    if full:
        try:
            reason += f" ({mib(shutil.disk_usage(directory).free)} free there)"
        except OSError:
            pass
    return reason


def make_dir(path: Path) -> None:
    """`mkdir -p`, its failure one line (a read-only file system, a parent that cannot be made)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteFailed.of(path, err, "could not make the directory") from err


def atomic_write(path: Path, write: Any) -> None:
    """Calls `write(file)` on a temporary file beside `path`, then renames it into place.

    A crash at any moment leaves either the old file or the new one, never a part.
    """
    make_dir(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise WriteFailed.of(path, err) from err
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, shared_file_mode())  # mkstemp makes files private; others on a cluster read runs
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        reason = why_not_written(err, path.parent) if isinstance(err, Exception) else None
        if reason is None:
            raise
        raise WriteFailed(path, reason) from err
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

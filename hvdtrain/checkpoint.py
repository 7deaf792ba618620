"""Checkpoints: written by rank 0 only, atomically, loadable with `weights_only=True`.

Layout in the run directory:
    checkpoints/epoch-0003.pt   one per checkpointed epoch
    checkpoints/last.pt         the newest (a hard link to it, replaced atomically)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from hvdtrain.errors import UserError

LAST = "last.pt"


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
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "checkpoints"

    def save(self, state: dict[str, Any], epoch: int) -> Path:
        """Writes epoch `epoch`'s checkpoint and points last.pt at it (rank 0 only)."""
        path = self.dir / f"epoch-{epoch:04d}.pt"
        atomic_write(path, lambda handle: torch.save(state, handle))
        self._point_last_at(path)
        return path

    def _point_last_at(self, path: Path) -> None:
        tmp = self.dir / f".{LAST}.link"
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:  # file systems without hard links get a copy
            atomic_write(tmp, lambda handle: handle.write(path.read_bytes()))
        os.replace(tmp, self.dir / LAST)
        _fsync_dir(self.dir)

    def latest(self) -> Path | None:
        path = self.dir / LAST
        return path if path.is_file() else None

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """Reads a checkpoint without running pickled code (`weights_only=True`)."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise UserError(f"checkpoint '{path}' cannot be read ({type(err).__name__}: {err}); "
                            "it may be truncated or from another program") from err
        missing = [k for k in ("model", "optimizer", "epoch", "step") if k not in state]
        if missing:
            raise UserError(f"checkpoint '{path}' lacks {', '.join(missing)}: it was not written by hvdtrain fit")
        return state

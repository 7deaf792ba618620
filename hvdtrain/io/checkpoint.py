"""Checkpoints: written by rank 0 only, atomically, verified by sha256, loadable with `weights_only=True`.

Layout in the run directory:
    checkpoints/epoch-0003.pt   one per checkpointed epoch (the last K and the best are kept)
    checkpoints/epoch-0004-sample-000001280.pt   one written inside epoch 4, 1280 samples into its order
    checkpoints/manifest.json   each kept checkpoint's epoch, position, step, metrics and sha256
    checkpoints/last.pt         the newest, and best.pt the best by the chosen metric (hard links)

Writes go in an order that a crash at any moment cannot spoil: the checkpoint file
(temporary name, fsync, rename), then the manifest (the same way), then the links,
then deleting old files. A resume takes the newest checkpoint whose sha256 matches.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch

from hvdtrain.errors import UserError
from hvdtrain.io.atomic import atomic_write, fsync_dir

LAST, BEST, MANIFEST = "last.pt", "best.pt", "manifest.json"
REQUIRED_KEYS = ("model", "optimizer", "epoch", "step")


def best_entry(entries: list[dict[str, Any]], key: str, maximize: bool) -> dict[str, Any] | None:
    """The entry (epoch record, checkpoint) with the best `key`; ties go to the later one.
    None when no entry has a number for it (NaN does not count)."""
    scored = [e for e in entries if isinstance(e.get(key), (int, float)) and not math.isnan(e[key])]
    if not scored:
        return None
    sign = 1 if maximize else -1
    return max(reversed(scored), key=lambda e: sign * e[key])


def _order(entry: dict[str, Any]) -> tuple[int, int]:
    """Where in the run a checkpoint was written: whole epochs, then samples into the next one."""
    return entry["epoch"], entry.get("position", 0)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class CheckpointStore:
    def __init__(self, run_dir: Path, keep_last: int = 3, best_metric: str = "val_loss", maximize: bool = False):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.maximize = maximize

    def save(self, state: dict[str, Any], epoch: int, metrics: dict[str, float]) -> Path:
        """Writes the checkpoint after `epoch` whole epochs and `state["position"]` samples of the next
        (0: at the end of an epoch) and records it (rank 0 only)."""
        position = int(state.get("position", 0))
        name = f"epoch-{epoch + 1:04d}-sample-{position:09d}.pt" if position else f"epoch-{epoch:04d}.pt"
        path = self.dir / name
        atomic_write(path, lambda handle: torch.save(state, handle))
        entry = {"file": path.name, "epoch": epoch, "position": position, "step": state["step"],
                 "sha256": sha256_of(path), **metrics}
        # Entries past this one are from a run that went further before it was resumed from here: replaced.
        entries = [e for e in self._entries() if _order(e) < _order(entry)] + [entry]
        best = best_entry(entries, self.best_metric, self.maximize) or entries[-1]
        recent = entries[-self.keep_last:]
        kept = sorted(recent + ([] if best in recent else [best]), key=_order)
        manifest = {"best_metric": self.best_metric, "maximize": self.maximize, "best": best["file"],
                    "checkpoints": kept}
        text = json.dumps(manifest, indent=2) + "\n"
        atomic_write(self.dir / MANIFEST, lambda handle: handle.write(text.encode()))
        self._link(self.dir / LAST, path)
        self._link(self.dir / BEST, self.dir / best["file"])
        keep = {e["file"] for e in kept}
        for old in self.dir.glob("epoch-*.pt"):
            if old.name not in keep:
                old.unlink(missing_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # left by a crash in an earlier write
            stale.unlink(missing_ok=True)
        return path

    def latest_valid(self, warn: Callable[[str], None] = lambda message: None) -> Path | None:
        """The newest checkpoint that is intact; `warn` hears about each one skipped."""
        entries = self._entries()
        if entries:
            for entry in reversed(entries):
                path = self.dir / entry["file"]
                if not path.is_file():
                    warn(f"checkpoint {path} is listed in {MANIFEST} but missing; trying an older one")
                elif sha256_of(path) != entry["sha256"]:
                    warn(f"checkpoint {path} is corrupt or truncated (its sha256 does not match {MANIFEST}); "
                         "trying an older one")
                else:
                    return path
            return None
        # No manifest (a directory from elsewhere): the newest file that loads.
        for path in sorted(self.dir.glob("epoch-*.pt"), reverse=True):
            try:
                self.load(path)
                return path
            except UserError as err:
                warn(f"{err}; trying an older one")
        return None

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """Reads a checkpoint without running pickled code (`weights_only=True`)."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise UserError(f"checkpoint '{path}' cannot be read ({type(err).__name__}: {err}); "
                            "it may be truncated or from another program") from err
        missing = [k for k in REQUIRED_KEYS if k not in state]
        if missing:
            raise UserError(f"checkpoint '{path}' lacks {', '.join(missing)}: it was not written by hvdtrain fit")
        return state

    def _entries(self) -> list[dict[str, Any]]:
        path = self.dir / MANIFEST
        if not path.is_file():
            return []
        try:
            return sorted(json.loads(path.read_text())["checkpoints"], key=_order)
        except (ValueError, KeyError):
            return []  # unreadable: fall back to loading the files themselves

    def _link(self, link: Path, target: Path) -> None:
        tmp = link.with_name(f".{link.name}.link.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(target, tmp)
        except OSError:  # file systems without hard links get a copy
            atomic_write(tmp, lambda handle: handle.write(target.read_bytes()))
        os.replace(tmp, link)
        fsync_dir(self.dir)

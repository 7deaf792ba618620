"""Checkpoints on disk, the one module that writes and reads them: written by rank 0 only, atomically,
verified by sha256, loadable with `weights_only=True`.

Layout in the run directory:
    checkpoints/epoch-0003.pt   one per checkpointed epoch (the last K and the best are kept)
    checkpoints/epoch-0004-sample-000001280.pt   one written inside epoch 4, 1280 samples into its order
    checkpoints/manifest.json   each kept checkpoint's epoch, position, step, metrics and sha256
    checkpoints/last.pt         the newest, and best.pt the best by the chosen metric (hard links)
    checkpoints/epoch-0004.pt.rank-1.optim   with a sharded optimizer: rank 1's share of its state
                                (rank 0's is in the checkpoint itself, which names the others with sha256)

Writes go in an order that a crash at any moment cannot spoil: the optimizer pieces and the
checkpoint file (each: temporary name, fsync, rename), then the manifest (the same way), then the links,
then deleting old files. A resume takes the newest checkpoint whose sha256 matches.

What a checkpoint holds is `CheckpointState`; where a resumed run begins, read back from one, is
`Start` (older checkpoints' keys migrated here too).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hvdtrain.errors import UserError
from hvdtrain.io.atomic import atomic_write, fsync_dir

CHECKPOINTS, LAST, BEST, MANIFEST = "checkpoints", "last.pt", "best.pt", "manifest.json"
PIECE = ".optim"  # epoch-0004.pt.rank-1.optim: rank 1's share of a sharded optimizer's state
REQUIRED_KEYS = ("model", "optimizer", "epoch", "step")
NAMED = {"best": BEST, "last": LAST}


@dataclass
class CheckpointState:
    """What one checkpoint holds: after `epoch` whole epochs and `step` optimizer steps; one written
    inside an epoch also holds where in it (`position`), the epoch's sums so far and every rank's
    random states, and of a stream the plan of what its ranks serve (`stream_plan`)."""

    model: dict[str, Any]
    optimizer: dict[str, Any]
    epoch: int
    step: int
    world_size: int
    lr_batch: int
    scaler: dict[str, Any]
    task: str
    shapes: dict[str, Any]
    """What `evaluate`, `predict` and `export` rebuild the model from."""
    config: dict[str, Any]
    position: int | None = None
    """Samples of the next epoch's order done; None at an epoch's end."""
    sums: list[float | int] | None = None
    rng: list[dict[str, Any]] | None = None
    """Rank r's random states at index r."""
    stream_plan: dict[str, Any] | None = None
    optimizer_pieces: list[dict[str, str]] | None = None
    """The files holding what only the other ranks hold, each with its sha256: a sharded optimizer's
    shares of the state (`optimizer` holds rank 0's and the groups), PowerSGD's error buffers."""
    powersgd: dict[str, Any] | None = None
    """PowerSGD's state: `world_size`, the `factors` and `errors` by rank (rank 0's here, the others'
    in the pieces)."""
    step_window: list[float] | None = None
    """With run.log_every: the step log's window under way (its loss sum and count over every rank, per
    process)."""
    train_samples: int | None = None
    """Inside an epoch: the training set's length, whose order `position` counts in (a resume on another
    length cannot go on in the same order)."""

    def to_dict(self) -> dict[str, Any]:
        state = {"model": self.model, "optimizer": self.optimizer, "epoch": self.epoch, "step": self.step,
                 "world_size": self.world_size, "lr_batch": self.lr_batch, "scaler": self.scaler, "task": self.task,
                 "shapes": self.shapes, "config": self.config}
        if self.position is not None:
            state.update(position=self.position, sums=self.sums, rng=self.rng, train_samples=self.train_samples)
        if self.stream_plan is not None:
            state.update(stream_plan=self.stream_plan)
        if self.optimizer_pieces:
            state.update(optimizer_pieces=self.optimizer_pieces)
        if self.powersgd is not None:
            state.update(powersgd=self.powersgd)
        if self.step_window is not None:
            state.update(step_window=self.step_window)
        return state


@dataclass
class Start:
    """Where training begins: `epoch` whole epochs done, then `position` samples into the next one's
    order (0: at its start). A mid-epoch checkpoint also gives the epoch's sums so far, reduced over
    ranks, and each rank's random states."""

    epoch: int = 0
    step: int = 0
    position: int = 0
    sums: tuple[float, int, int, int] = (0.0, 0, 0, 0)
    rng: list[dict[str, Any]] | None = None
    world_size: int = 0
    lr_batch: int = 0
    """The global batch the run's lr is for (0: a fresh run, the config's)."""
    stream_plan: dict[str, Any] | None = None
    """Of a stream stopped inside an epoch: what its sampler needs to go on (the sampler's `state_at`)."""
    step_window: list[float] | None = None
    """The step log's window under way at the checkpoint, for rank 0 to go on with (`StepLog.resume`)."""

    @classmethod
    def of(cls, state: dict[str, Any]) -> "Start":
        """Where a loaded checkpoint leaves the run."""
        # Checkpoints from before optim.lr_batch: their lr was for one process's batch.
        lr_batch = state.get("lr_batch") or state.get("config", {}).get("data", {}).get("batch_size", 0)
        return cls(int(state["epoch"]), int(state["step"]), int(state.get("position", 0)),
                   tuple(state.get("sums", (0.0, 0, 0, 0))), state.get("rng"), int(state.get("world_size", 0)),
                   int(lr_batch), state.get("stream_plan"), state.get("step_window"))


def split_adamw_groups(saved: dict[str, Any], dims: list[int]) -> dict[str, Any]:
    """An AdamW optimizer state from before biases and norm scales got a group of their own (one group
    of every parameter in the model's order, whose dimensions are `dims`), split as AdamW's groups are
    made now: weights of 2 or more dimensions, then the rest without weight decay. Anything else as it is."""
    groups = saved.get("param_groups", [])
    if len(groups) != 1 or len(groups[0]["params"]) != len(dims):
        return saved  # not this model's: load_state_dict says so
    old = groups[0]
    split = [{**old, "params": [i for i, d in zip(old["params"], dims) if d >= 2]},
             {**old, "weight_decay": 0.0, "params": [i for i, d in zip(old["params"], dims) if d < 2]}]
    return {**saved, "param_groups": [g for g in split if g["params"]]}


def _read(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"checkpoint '{path}' cannot be read ({type(err).__name__}: {err}); "
                        "it may be truncated or from another program") from err


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
    """The checkpoints of one run directory."""

    def __init__(self, run_dir: Path, keep_last: int = 3, best_metric: str = "val_loss", maximize: bool = False):
        self.dir = Path(run_dir) / CHECKPOINTS
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.maximize = maximize

    @staticmethod
    def file_name(epoch: int, position: int) -> str:
        """The checkpoint after `epoch` whole epochs and `position` samples of the next."""
        return f"epoch-{epoch + 1:04d}-sample-{position:09d}.pt" if position else f"epoch-{epoch:04d}.pt"

    def save_piece(self, checkpoint: str, rank: int, piece: dict[str, Any]) -> dict[str, str]:
        """Writes rank `rank`'s share of a sharded optimizer's state, beside checkpoint file `checkpoint`
        (written before it, so that the checkpoint can name it with its sha256)."""
        path = self.dir / f"{checkpoint}.rank-{rank}{PIECE}"
        atomic_write(path, lambda handle: torch.save(piece, handle))
        return {"file": path.name, "sha256": sha256_of(path)}

    def save(self, state: dict[str, Any], epoch: int, metrics: dict[str, float]) -> Path:
        """Writes the checkpoint after `epoch` whole epochs and `state["position"]` samples of the next
        (0: at the end of an epoch) and records it (rank 0 only)."""
        position = int(state.get("position", 0))
        path = self.dir / self.file_name(epoch, position)
        atomic_write(path, lambda handle: torch.save(state, handle))
        entry = {"file": path.name, "epoch": epoch, "position": position, "step": state["step"],
                 "sha256": sha256_of(path), **metrics}
        if state.get("optimizer_pieces"):
            entry["pieces"] = state["optimizer_pieces"]
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
        for old in self.dir.glob(f"epoch-*{PIECE}"):
            if old.name.split(".rank-")[0] not in keep:
                old.unlink(missing_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # left by a crash in an earlier write
            stale.unlink(missing_ok=True)
        return path

    def has_any(self) -> bool:
        """Whether any checkpoint file is there (intact or not)."""
        return any(self.dir.glob("epoch-*.pt"))

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
                elif (broken := self._broken_piece(entry.get("pieces", []))) is not None:
                    warn(f"checkpoint {path}'s optimizer state piece {broken}; trying an older one")
                else:
                    return path
            return None
        # No manifest (a directory from elsewhere): the newest file that loads.
        for path in sorted(self.dir.glob("epoch-*.pt"), reverse=True):
            try:
                self.load(path, optimizer=False)
                return path
            except UserError as err:
                warn(f"{err}; trying an older one")
        return None

    def named(self, which: str) -> Path:
        """best.pt or last.pt (`which`: 'best' or 'last')."""
        return self.dir / NAMED[which]

    def recorded_sha256(self, which: str) -> str | None:
        """The sha256 the manifest records for best.pt, last.pt or a kept file by its name (`epoch-0003.pt`);
        None without a readable manifest or an entry."""
        manifest, entries = self._manifest(), self._entries()
        try:
            name = which
            if which == "best":
                name = manifest["best"]  # type: ignore[index]
            elif which == "last":
                name = entries[-1]["file"]
            return next(e["sha256"] for e in entries if e["file"] == name)
        except (TypeError, KeyError, IndexError, StopIteration):
            return None

    def best_rule(self) -> tuple[str, bool] | None:
        """(the metric best.pt is chosen by, whether higher is better); None without a readable manifest."""
        manifest = self._manifest()
        try:
            return manifest["best_metric"], bool(manifest["maximize"])  # type: ignore[index]
        except (TypeError, KeyError):
            return None

    def _broken_piece(self, pieces: list[dict[str, str]]) -> str | None:
        """What is wrong with the first missing or corrupt piece, or None."""
        for piece in pieces:
            path = self.dir / piece["file"]
            if not path.is_file():
                return f"{path} is missing"
            if sha256_of(path) != piece["sha256"]:
                return f"{path} is corrupt or truncated"
        return None

    @staticmethod
    def load(path: Path, optimizer: bool = True) -> dict[str, Any]:
        """Reads a checkpoint without running pickled code (`weights_only=True`); with `optimizer`, a sharded
        optimizer's pieces are read too, one by one, and its state is whole again (any world size loads
        it). Without, the weights and the rest need only the checkpoint file (evaluate, predict, export)."""
        state = _read(path)
        missing = [k for k in REQUIRED_KEYS if k not in state]
        if missing:
            raise UserError(f"checkpoint '{path}' lacks {', '.join(missing)}: it was not written by hvdtrain fit")
        for piece in state.get("optimizer_pieces", []) if optimizer else []:
            piece_path = path.parent / piece["file"]
            if not piece_path.is_file() or sha256_of(piece_path) != piece["sha256"]:
                raise UserError(f"checkpoint '{path}' names the optimizer state piece {piece_path}, which is missing "
                                "or does not match its sha256: resume from an older checkpoint (remove this one)")
            piece = _read(piece_path)
            state["optimizer"]["state"].update(piece.get("state", {}))
            if "powersgd_errors" in piece:
                state["powersgd"]["errors"][piece["rank"]] = piece["powersgd_errors"]
        return state

    def _manifest(self) -> dict[str, Any] | None:
        try:
            manifest = json.loads((self.dir / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

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

"""Run directories read back: `hvdtrain runs` lists them, `hvdtrain plot` draws their curves.

    hvdtrain runs                    # every run under runs/
    hvdtrain plot runs/np1 runs/np4  # loss and metrics against epoch and wall time, overlaid
"""

from __future__ import annotations

import functools
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hvdtrain.config.loading import read_yaml
from hvdtrain.errors import UserError
from hvdtrain.io.run_lock import glance


@dataclass
class RunRecord:
    path: Path
    config: dict[str, Any]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl: one record per epoch done."""
    summary: dict[str, Any] | None = None

    @property
    def planned_epochs(self) -> int | None:
        return (self.config.get("train") or {}).get("epochs")

    @property
    def world_size(self) -> int | None:
        source = self.summary or (self.epochs[-1] if self.epochs else {})
        return source.get("world_size")

    @functools.cached_property
    def lock(self) -> tuple[bool, dict]:
        """Whether a fit holds the run directory, and its lock's note (run_lock.glance), once per record."""
        return glance(self.path)

    @property
    def status(self) -> str:
        done = self.epochs[-1]["epoch"] if self.epochs else 0
        held, note = self.lock
        if held:
            host = note.get("host")
            return "running" if host in (None, socket.gethostname()) else f"running on {host}"
        if self.summary is not None and done >= (self.planned_epochs or 0):
            return "finished"
        epoch = f"in epoch {min(done + 1, self.planned_epochs or done + 1)}"
        ended, at = note.get("ended"), note.get("at")
        if isinstance(ended, str) and ended:  # the last fit's own word: a signal's stop, a failure (and where)
            if ended.startswith("stopped by"):
                return ended
            return f"{ended} at {at}" if isinstance(at, str) and at else f"{ended} {epoch}"
        if note.get("pid"):  # its note was left behind: the process ended without unwinding
            host = note.get("host")
            return f"crashed {epoch}" if host in (None, socket.gethostname()) else \
                f"crashed {epoch} on {host} (or running there, beyond this file system's locks)"
        if self.summary is not None and self.summary.get("stopped"):
            return f"stopped early after epoch {done}"
        return "not started" if not done else f"stopped after epoch {done}"

    @property
    def error(self) -> str | None:
        """Why the last fit failed, as it said, where it did."""
        error = self.lock[1].get("error")
        return str(error) if error else None

    def best(self) -> tuple[str, float | None, int | None]:
        """(metric, best value, its epoch): the summary's, or from the epochs done."""
        if self.summary and self.summary.get("best_metric"):
            return self.summary["best_metric"], self.summary.get("best_value"), self.summary.get("best_epoch")
        from hvdtrain.io.checkpoint import CheckpointStore, best_entry

        # An unfinished run: the checkpoints' manifest knows the metric and its direction.
        name, maximize = CheckpointStore(self.path).best_rule() or ("val_loss", False)
        found = best_entry(self.epochs, name, maximize) or {}
        return name, found.get(name), found.get("epoch")

    def samples_per_s(self) -> float | None:
        if self.summary and self.summary.get("train_samples_per_s"):
            return float(self.summary["train_samples_per_s"])
        rates = [r["train_samples_per_s"] for r in self.epochs if "train_samples_per_s" in r]
        return sum(rates) / len(rates) if rates else None


def read_run(path: Path) -> RunRecord:
    """A run directory's files; a clear error when `path` is not one."""
    from hvdtrain.io.run_dir import read_metrics  # imports torch: only when a run is read

    if not (path / "config.yaml").is_file():
        raise UserError(f"'{path}' is not a run directory (it has no config.yaml): pass the --run-dir of a fit")
    try:
        config = read_yaml((path / "config.yaml").read_text()) or {}
        metrics = path / "metrics.jsonl"
        epochs = read_metrics(metrics)
        summary_file = path / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    except (ValueError, yaml.YAMLError) as err:
        raise UserError(f"run directory '{path}' has a file that does not parse ({err}): was it edited by hand?") from err
    return RunRecord(path, config, epochs, summary)


def find_runs(root: Path) -> list[RunRecord]:
    """Every run directory at or below `root` (sorted by path); unreadable ones are skipped."""
    if not root.is_dir():
        raise UserError(f"'{root}' is not a directory: pass the directory that holds your runs (default runs)")
    found = []
    for config in sorted(root.rglob("config.yaml")):
        try:
            found.append(read_run(config.parent))
        except UserError:
            continue
    return found


def table(runs: list[RunRecord]) -> str:
    """One line per run, columns aligned."""
    rows = [("run", "world size", "epochs", "best", "samples/s", "status")]
    for run in runs:
        name, value, epoch = run.best()
        best = f"{name} {value:.4f} (epoch {epoch})" if value is not None else "-"
        rate = run.samples_per_s()
        done = run.epochs[-1]["epoch"] if run.epochs else 0
        rows.append((str(run.path), str(run.world_size or "-"), f"{done}/{run.planned_epochs or '?'}", best,
                     f"{rate:,.0f}" if rate else "-", run.status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def as_json(runs: list[RunRecord]) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        name, value, epoch = run.best()
        out.append({"run": str(run.path), "world_size": run.world_size, "epochs_done": run.epochs[-1]["epoch"]
                    if run.epochs else 0, "epochs": run.planned_epochs, "best_metric": name, "best_value": value,
                    "best_epoch": epoch, "train_samples_per_s": run.samples_per_s(), "status": run.status,
                    "error": run.error})
    return out

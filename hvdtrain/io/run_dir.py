"""The run directory: chosen and prepared by rank 0, never clobbered by accident.

    config.yaml     the effective configuration
    metrics.jsonl   one JSON object per epoch
    summary.json    the final figures
    events.out.tfevents.*   TensorBoard's (run.tensorboard)
    horovod-timeline.json   Horovod's timeline (run.horovod_timeline)
    checkpoints/    see hvdtrain.io.checkpoint
    where.json      while the job runs: how `hvdtrain where` reaches it (left behind by a killed job)
    where/          every rank's report at a stall or when asked
    mlflow_run_id   the MLflow run a resumed run goes on logging to
    .hvdtrain.lock  rank 0's claim while its fit runs (hvdtrain.io.run_lock)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hvdtrain.io import run_lock
from hvdtrain.io.atomic import WriteFailed, atomic_write, make_dir
from hvdtrain.io.checkpoint import CHECKPOINTS, CheckpointStore, best_entry
from hvdtrain.io.mlflow_log import RUN_ID_FILE
from hvdtrain.config import RunConfig
from hvdtrain.config.loading import write_yaml
from hvdtrain.engine.environment import torchrun_restarts
from hvdtrain.errors import UserError

TIMELINE = "horovod-timeline.json"
CONFIG_FILE = "config.yaml"  # the run's settings, as --config reads them
METRICS = "metrics.jsonl"
WHERE_FILE = "where.json"
"""In a running job's run directory: how `hvdtrain where` reaches rank 0 (removed when the job ends)."""
WHERE_FOLDER = "where"


def read_metrics(path: Path, warn: Callable[[str], None] = lambda message: None) -> list[dict[str, Any]]:
    """The epoch records of a metrics.jsonl. A line that is not a whole record (the machine stopped
    mid-write) is dropped, and `warn` hears which: the epoch it records is trained again on resume."""
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("epoch"), int):
            warn(f"{path} line {number} is not a whole epoch record (cut short when the run stopped?): dropped")
            continue
        records.append(record)
    return records


def after_a_restart(cfg: RunConfig, say: Callable[[str], None]) -> RunConfig:
    """torchrun --max-restarts starts every worker again once one failed: with a run directory, the run
    goes on from its newest checkpoint there (`--resume auto`), whatever the command line said of it (its
    --overwrite would wipe that checkpoint, and plain fit would refuse the directory, which holds a run)."""
    restarts = torchrun_restarts()
    if not restarts or cfg.resume is True:
        return cfg
    if cfg.dir is None:
        say(f"hvdtrain: warning: torchrun started the workers again (restart {restarts}), and without --run-dir "
            "this run starts afresh in a new directory: give --run-dir to go on from its checkpoints")
        return cfg
    say(f"hvdtrain: torchrun started the workers again (restart {restarts}): going on from the newest "
        f"checkpoint in {cfg.dir}, if it has one (as --resume auto)")
    return dataclasses.replace(cfg, resume="auto", overwrite=False)


def prepare_run_dir(cfg: RunConfig, claimed: bool = True) -> tuple[Path, bool]:
    """Checks the directory against --resume/--overwrite and makes it ready (rank 0 only).
    Returns it and whether the run goes on from a checkpoint there. `claimed`: this process holds
    it (run_lock) until its fit ends, and a job running there already is refused before anything
    changes."""
    path, resuming, holds_a_run = _decided(cfg)
    if path is None:
        path = _fresh_default_dir()
        _claim(path, claimed)
        return path, False
    if resuming:
        _claim(path, claimed)
        return path, True
    make_dir(path)
    key = _claim(path, claimed)  # before anything goes: a job still writing there keeps it all
    if holds_a_run:
        try:
            _empty(path)
        except BaseException:
            run_lock.release(key)
            raise
    return path, False


def check_run_dir(cfg: RunConfig, claimed: bool = True) -> None:
    """prepare_run_dir's refusals, with nothing made, claimed or removed: rank 0 says them before the
    data is made (a download, maybe), and prepare_run_dir decides again when the run begins."""
    path, _, _ = _decided(cfg)
    if path is not None and claimed:
        run_lock.check_free(path)


def _decided(cfg: RunConfig) -> tuple[Path | None, bool, bool]:
    """What prepare_run_dir does with --run-dir, or the UserError that refuses it: the directory (None:
    a fresh one under runs/), whether the run resumes from a checkpoint there, and whether it holds
    files of an earlier run (emptied where the run starts again)."""
    if cfg.dir is None:
        if cfg.resume:
            raise UserError(f"--resume{' auto' if cfg.resume == 'auto' else ''} needs --run-dir: the run directory "
                            "to continue")
        return None, False, False
    path = Path(cfg.dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"run directory '{path}' is a file: choose another --run-dir")
    has_content = path.is_dir() and any(entry.name != run_lock.LOCK_FILE for entry in path.iterdir())
    has_checkpoints = CheckpointStore(path).has_any()
    if cfg.resume == "auto":
        if has_checkpoints:
            return path, True, has_content
        foreign = sorted(entry.name for entry in path.iterdir() if not _is_run_file(entry)) if has_content else []
        if foreign:
            raise UserError(f"--resume auto: '{path}' has no checkpoint to resume and holds files that are not a "
                            f"run's ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): choose another "
                            "--run-dir")
        running = _running_job(path)
        if running:
            raise UserError(f"--resume auto: a job is still running in '{path}' ({running}) and has written no "
                            "checkpoint yet: stop it first, or choose another --run-dir")
        # a run stopped before its first checkpoint (or never started): its own files only, replaced
    elif cfg.resume:
        if not has_checkpoints:
            raise UserError(f"nothing to resume in '{path}': it has no checkpoints; drop --resume to start a new run")
        return path, True, has_content
    elif has_content and not cfg.overwrite:
        raise UserError(
            f"run directory '{path}' already holds a run: pass --resume to continue it, "
            "--overwrite to start it again, or choose another --run-dir"
        )
    return path, False, has_content


def _claim(path: Path, claimed: bool) -> Path | None:
    return run_lock.claim(path) if claimed else None


def _empty(path: Path) -> None:
    """Removes the old run for --overwrite, all but the lock file held open (on NFS, a file deleted
    while open stays as .nfsXXXX and the directory could not go): the directory itself stays too (a
    symbolic link to one, say)."""
    try:
        for entry in path.iterdir():
            if entry.name == run_lock.LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError as err:
        raise UserError(f"could not remove the old run in '{path}' for --overwrite: {err.strerror or err} "
                        f"({err.filename}); remove it yourself, or choose another --run-dir") from None


RUN_FILES = (CONFIG_FILE, METRICS, "summary.json", TIMELINE, CHECKPOINTS, "events.out.tfevents.*", WHERE_FILE,
             f".{WHERE_FILE}.*", WHERE_FOLDER, RUN_ID_FILE, ".*.tmp", run_lock.LOCK_FILE)
"""What `fit` may leave in a run directory before its first checkpoint (killed at any moment)."""


def _running_job(path: Path) -> str:
    """Rank 0 of the job whose `where.json` is in `path`, where it still runs on this host; "" otherwise
    (one killed leaves the file behind; one on another host cannot be asked from here)."""
    try:
        facts = json.loads((path / WHERE_FILE).read_text())
        pid, host = int(facts["pid"]), str(facts["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if host != socket.gethostname():
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:  # alive, another user's
        pass
    return f"rank 0 is process {pid} on {host}"


def _is_run_file(entry: Path) -> bool:
    """Whether `fit` writes a file of this name into a run directory."""
    return any(entry.match(pattern) for pattern in RUN_FILES)


def _fresh_default_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in ["", *(f"-{n}" for n in range(2, 1000))]:
        path = Path("runs") / f"fit-{stamp}{suffix}"
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
        except OSError as err:
            raise WriteFailed.of(path, err, "could not make the directory", directory=Path.cwd()) from err
    raise UserError("could not find a free run directory under runs/: pass --run-dir")


class RunFiles:
    """Writes the run directory's files (rank 0 only)."""

    def __init__(self, path: Path, trackers: Sequence[Any] = ()):
        self.path = path
        self.trackers = list(trackers)
        """TensorBoard's EventLog, MLflowLog: each has epoch(record), steps(step, values) and close()."""

    def write_config(self, config: dict[str, Any]) -> None:
        text = write_yaml(config, sort_keys=False)
        atomic_write(self.path / CONFIG_FILE, lambda handle: handle.write(text.encode()))

    def append_metrics(self, record: dict[str, Any]) -> None:
        try:
            with open(self.path / METRICS, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as err:  # a line torn by it is dropped on resume
            raise WriteFailed.of(self.path / METRICS, err) from err
        for tracker in self.trackers:
            tracker.epoch(record)

    def log_steps(self, step: int, values: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.steps(step, values)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()

    def truncate_metrics(self, after_epoch: int, warn: Callable[[str], None] = lambda message: None) -> None:
        """On resume: drops records of epochs after the checkpoint, which are replayed, and torn lines."""
        path = self.path / METRICS
        if not path.exists():
            return
        kept = [record for record in read_metrics(path, warn) if record["epoch"] <= after_epoch]
        text = "".join(json.dumps(record) + "\n" for record in kept)
        atomic_write(path, lambda handle: handle.write(text.encode()))

    def best_record(self, key: str, higher_is_better: bool) -> dict[str, Any]:
        """The epoch record with the best `key` in metrics.jsonl (ties: the later epoch)."""
        return best_entry(read_metrics(self.path / METRICS), key, higher_is_better) or {}

    def write_summary(self, summary: dict[str, Any]) -> None:
        text = json.dumps(summary, indent=2) + "\n"
        atomic_write(self.path / "summary.json", lambda handle: handle.write(text.encode()))
        for tracker in self.trackers:
            if hasattr(tracker, "finish"):  # the summary and the best checkpoint as artifacts
                tracker.finish(self.path / "summary.json", CheckpointStore(self.path).named("best"))

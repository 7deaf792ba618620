"""The checkpoint protocol of a run: what goes into a checkpoint (from the run), rank 0's write in a
thread of its own while every rank waits for it, and the restore into the model and optimizer when a
run resumes. The files themselves are `hvdtrain.io.checkpoint`'s.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from hvdtrain.config import Config
from hvdtrain.config.components import BUILT_IN_OPTIMIZERS
from hvdtrain.data.sampler import TrainingSampler
from hvdtrain.engine import Engine
from hvdtrain.engine.base import on_cpu
from hvdtrain.errors import UserError, message_lines
from hvdtrain.io.atomic import WriteFailed, why_not_written
from hvdtrain.io.checkpoint import CheckpointState, CheckpointStore, Start, split_adamw_groups
from hvdtrain.io.progress import say
from hvdtrain.io.run_dir import CONFIG_FILE
from hvdtrain.train.loggers import StepLog
from hvdtrain.train.loop import EpochSums
from hvdtrain.train.random_state import rng_state
from hvdtrain.train.running_stats import share_running_stats
from hvdtrain.models import load_weights, unwrapped
from hvdtrain.train.setup import Run

POLL_SECONDS = 0.5
WRITER_JOIN_SECONDS = 60.0  # how long a failing rank 0 lets its write finish before it goes on


class Checkpointer:
    """The run's checkpoints, written together: every rank calls `save_epoch` and `save_inside` at the
    same step (rank 0 writes, the others wait for it to say whether it could)."""

    def __init__(self, run: Run, config: Config, engine: Engine, run_dir: Path, best: tuple[str, bool],
                 step_log: StepLog):
        self.run, self.config, self.engine, self.step_log = run, config, engine, step_log
        self.store = CheckpointStore(run_dir, config.run.keep_last, *best)

    @property
    def last(self) -> Path:
        """Where the newest checkpoint is (on rank 0's file system)."""
        return self.store.named("last")

    def save_epoch(self, epoch: int, step: int, lr_batch: int, metrics: dict[str, float]) -> None:
        """At the end of `epoch`, with its validation metrics."""
        window = self.step_log.saved_window()  # dist

        def state() -> tuple[CheckpointState, int, dict[str, float]]:
            saved = self._state(epoch, step, lr_batch)
            saved.step_window = window
            return saved, epoch, metrics

        self._save_together(state, CheckpointStore.file_name(epoch, 0))

    def save_inside(self, epoch: int, step: int, lr_batch: int, position: int, sums: EpochSums,
                    sampler: TrainingSampler) -> None:
        """Inside `epoch`, `position` samples into its order: the sums so far reduced over ranks, each
        rank's random states, then rank 0 writes."""
        engine = self.engine
        window = self.step_log.local_window()  # None on every rank when the step log is off
        local = torch.stack([torch.as_tensor(sums.loss, dtype=torch.float64).cpu(),
                             torch.tensor(float(sums.samples), dtype=torch.float64),
                             torch.tensor(float(sums.kept), dtype=torch.float64),
                             *torch.tensor(window or [], dtype=torch.float64)])
        reduced = engine.allreduce_sum(local, "checkpoint_sums").tolist()  # dist: the step log's window too
        share_running_stats(self.run.model, engine, self.config.train.dist_bn)
        states = engine.allgather_object(rng_state(), "checkpoint_rng")  # dist: rank r's at index r

        def state() -> tuple[CheckpointState, int, dict[str, float]]:
            saved = self._state(epoch - 1, step, lr_batch)
            saved.position, saved.rng, saved.train_samples = position, states, _length(self.run.split.train)
            saved.sums = [reduced[0], int(reduced[1]), int(reduced[2]), sums.skipped]
            saved.step_window = self.step_log.saved_window(reduced[3:]) if window is not None else None
            saved.stream_plan = sampler.state_at(position)  # where each rank's range stands, for any world size
            return saved, epoch - 1, {}

        self._save_together(state, CheckpointStore.file_name(epoch - 1, position))

    def _state(self, epoch: int, step: int, lr_batch: int) -> CheckpointState:
        run, powersgd = self.run, self.engine.powersgd
        state = CheckpointState(unwrapped(run.model).state_dict(), run.optimizer.state_dict(), epoch, step,
                                self.engine.size, lr_batch, run.precision.state_dict(), run.task.name,
                                run.shapes.to_dict(), self.config.to_dict())
        if powersgd is not None:  # rank 0's errors; the others' arrive as pieces (CheckpointStore.load)
            own = powersgd.state_dict()
            state.powersgd = {"world_size": own["world_size"], "factors": own["factors"], "errors": {0: own["errors"]}}
        return state

    def _piece(self) -> dict[str, Any]:
        """What only this rank holds, for rank 0 to write beside the checkpoint: its share of a sharded
        optimizer's state, or its PowerSGD errors."""
        if self.engine.gradient_shards is not None:
            return {"state": on_cpu(self.run.optimizer.state_dict()["state"])}
        return {"rank": self.engine.rank, "powersgd_errors": self.engine.powersgd.state_dict()["errors"]}

    def _save_together(self, make: Callable[[], tuple[CheckpointState, int, dict]], name: str) -> None:
        """Rank 0 writes checkpoint `name` while every rank waits for it (with a sharded optimizer or PowerSGD,
        first what each other rank alone holds, as it arrives: no rank ever holds all of it); a failure to write (a
        full disk) or writes slower than run.checkpoint_timeout seconds stop every rank with one line."""
        engine, timeout = self.engine, self.config.run.checkpoint_timeout
        with engine.agree("checkpoint"):  # dist: the others learn how rank 0's write went
            engine.at("waiting for rank 0 to write a checkpoint")
            left = engine.doing("a checkpoint write")
            started, pieces = time.monotonic(), []
            writer, late, failed = None, False, False
            in_pieces = engine.gradient_shards is not None or engine.powersgd is not None
            for sender in range(1, engine.size) if in_pieces else ():
                share = self._piece() if engine.rank == sender else None
                received = engine.send_to_root(share, sender, "checkpoint_piece")  # dist
                writer = _Writer(functools.partial(_write_piece, self.store, name, sender, received, pieces)) \
                    if engine.is_root else None
                del share, received
                late, failed = self._wait_for(writer, started, timeout)
                if late or failed:
                    break
            if not (late or failed):
                writer = _Writer(functools.partial(_write_checkpoint, self.store, make, pieces)) if engine.is_root else None
                late, failed = self._wait_for(writer, started, timeout)
            if writer is not None:  # the others learn of a failure in the agreement, from rank 0's line
                writer.raise_failure(self.store, late, timeout)
            engine.doing(left)

    def _wait_for(self, writer: "_Writer | None", started: float, timeout: float) -> tuple[bool, bool]:
        """Until rank 0's `writer` is done: (whether it ran late, whether it failed), the same on every rank.
        dist: not one long wait in a collective (the stall watchdog, Horovod's stall inspector and the
        process group's timeout would each end a healthy job during a slow write) but short ones: every
        POLL_SECONDS a tiny allreduce of whether rank 0's writer thread is done."""
        try:
            while True:
                done = writer.wait(POLL_SECONDS) if writer is not None else False
                late = writer is not None and not done and time.monotonic() - started > timeout
                failed = writer is not None and done and writer.error is not None
                flags = self.engine.allreduce_sum(torch.tensor([float(done), float(late), float(failed)]),
                                                  "checkpoint_written").tolist()
                if flags[0] or flags[1]:
                    return bool(flags[1]), bool(flags[2])
        except BaseException:
            if writer is not None:  # another rank was lost meanwhile: not with a write still reading the model
                writer.wait(WRITER_JOIN_SECONDS)
            raise


def _write_piece(store: CheckpointStore, name: str, sender: int, share: dict[str, Any],
                 pieces: list[dict[str, str]]) -> None:
    pieces.append(store.save_piece(name, sender, share))


def _write_checkpoint(store: CheckpointStore, make: Callable[[], tuple[CheckpointState, int, dict]],
                      pieces: list[dict[str, str]]) -> None:
    state, epoch, metrics = make()
    state.optimizer_pieces = pieces
    store.save(state.to_dict(), epoch, metrics)


class _Writer:
    """One of rank 0's checkpoint writes, in a thread of its own so that its main thread can keep telling
    the others it is still writing."""

    def __init__(self, job: Callable[[], None]):
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._write, args=(job,), daemon=True,
                                        name="hvdtrain-checkpoint-writer")  # a write stuck on a dead disk must not hold the exit
        self._thread.start()

    def _write(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as err:  # noqa: BLE001 - raised in the main thread by raise_failure
            self.error = err

    def wait(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def raise_failure(self, store: CheckpointStore, late: bool, timeout: float) -> None:
        if late:
            raise UserError(f"writing a checkpoint into {store.dir} took longer than run.checkpoint_timeout "
                            f"({timeout:g} s); the checkpoints before it are intact: check that file system, or "
                            "raise run.checkpoint_timeout, then continue with --resume")
        if self.error is not None:
            self.failed(store, self.error)

    @staticmethod
    def failed(store: CheckpointStore, err: Exception) -> None:
        """Raises the line for a failed write."""
        reason = err.reason if isinstance(err, WriteFailed) else why_not_written(err, store.dir)
        if reason is None:
            raise err
        raise UserError(f"could not write a checkpoint into {store.dir}: {reason}; the "
                        "checkpoints before it are intact: free space, then continue with --resume") from err


def restore(run: Run, config: Config, run_dir: Path,
            engine: Engine) -> tuple[Start, dict[str, Any] | None, dict[str, Any] | None]:
    """Rank 0: loads the newest intact checkpoint into the model, optimizer (its share, when sharded) and
    gradient scaler, and says where the run goes on from. Returns that; with a sharded optimizer the
    whole optimizer state, for the others' shares (written on any world size, sharded or not); with
    PowerSGD its saved state where it fits this run (else it starts afresh, said here)."""
    path = CheckpointStore(run_dir).latest_valid(warn=lambda message: say(f"hvdtrain: warning: {message}"))
    if path is None:
        raise UserError(f"no intact checkpoint to resume in '{run_dir}/checkpoints': every one is corrupt or "
                        "missing; start a new run with --overwrite or another --run-dir")
    state = CheckpointStore.load(path)
    written_by = state.get("task")
    if written_by and written_by != run.task.name:  # the same shapes can still mean another loss and metrics
        raise UserError(f"checkpoint '{path}' was written by task '{written_by}', and this run's task is "
                        f"'{run.task.name}': resume with --task {written_by}, or start a new run in another --run-dir")
    try:
        load_weights(unwrapped(run.model), state["model"])
    except RuntimeError as err:
        saved = run_dir / CONFIG_FILE  # the settings of the run that wrote it, as a file --config reads
        objects = "hvdtrain.api:given." in str(state.get("config"))  # hvdtrain.fit's own objects: no file of them
        again = f": give them again, or add --config {saved}" if saved.is_file() and not objects else ""
        raise UserError(f"checkpoint '{path}' does not fit this model: {message_lines(err, 3)}; resume with the "
                        f"settings it was written with{_settings_changed(state.get('config', {}), config)}{again}") from err
    written = state.get("config", {}).get("optim", {}).get("name")
    another = UserError(f"checkpoint '{path}' holds the state of optimizer '{written}', which does not fit this "
                        f"run's '{config.optim.name}': resume with --optimizer {written}, or start a new run in "
                        "another --run-dir")
    # Two built-in optimizers' states can load into each other (SGD without momentum keeps none) and then
    # fail at the first step: refused by name. A factory of the user's may well take another's state.
    if written != config.optim.name and {written, config.optim.name} <= BUILT_IN_OPTIMIZERS:
        raise another
    whole = _optimizer_state(state["optimizer"], run, config)
    try:
        run.optimizer.load_state_dict(engine.own_share(run.optimizer, whole))
    except (ValueError, KeyError) as err:
        if written and written != config.optim.name:
            raise another from err
        raise UserError(f"checkpoint '{path}' has optimizer state that does not fit optim.name "
                        f"'{config.optim.name}': {err}") from err
    run.precision.load_state_dict(state.get("scaler", {}))
    start = Start.of(state)
    inside = f", {start.position} samples into epoch {state['epoch'] + 1}" if start.position else ""
    say(f"hvdtrain: resuming from {path} (epoch {state['epoch']}, step {state['step']}{inside})")
    changed = _changed_since(state.get("config", {}), config)
    if changed:  # a resume takes this command's settings: a flag left out of it goes back to its default
        say(f"hvdtrain: resuming with settings changed since that checkpoint: {', '.join(changed)}")
    before, now = state.get("train_samples"), _length(run.split.train)
    if start.position and state.get("stream_plan") is None and None not in (before, now) and before != now:
        say(f"hvdtrain: warning: the training set has {now} samples, {before} when this checkpoint was written: "
            f"the rest of epoch {state['epoch'] + 1} follows the new set's order, so some of its samples are seen "
            "twice or not at all in this epoch (the epochs after it are whole)")
    return start, whole if engine.gradient_shards is not None else None, _powersgd_state(state, engine)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # a stream without a length
        return None


SHAPING_KEYS = ("data.name", "data.image_size", "data.augment", "data.features", "data.classes", "data.num_classes",
                "data.context", "data.input_columns", "data.target_column", "model.name", "model.args", "model.hidden",
                "task.name", "task.args")
"""The config keys that decide the model's shapes, named when a checkpoint does not fit."""


def _settings_changed(written: dict[str, Any], config: Config) -> str:
    """`: <key> was X, now Y, ...` for the keys that shape the model and differ from the checkpoint's run."""
    changed = [f"{key} was {then!r}, now {now!r}" for key, then, now in _changes(written, config) if key in SHAPING_KEYS]
    return f" ({'; '.join(changed)})" if changed else ""


OPERATIONAL_KEYS = ("train.device", "train.channels_last", "train.compile", "train.threads", "train.stall_timeout",
                    "train.straggler_factor", "train.keep_freed_memory", "train.engine", "train.elastic",
                    "train.commit_every", "train.shard_optimizer", "data.num_workers")
"""Settings of how a run goes that leave what it learns alone (with run.*): not named when a resume changes them."""


def _changes(written: dict[str, Any], config: Config) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's run's value, this run's) for each setting that differs, run.* aside."""
    found = []
    for section, settings in config.to_dict().items():
        if section == "run" or not isinstance(written.get(section), dict):
            continue
        for name, now in settings.items():
            key, then = f"{section}.{name}", written[section].get(name, now)  # a key its hvdtrain lacked: as now
            if key == "data.name" and isinstance(then, str) and str(now).endswith(os.sep + then):
                continue  # kept relative before runs kept their data's path absolute
            if then != now:
                found.append((key, then, now))
    return found


def _changed_since(written: dict[str, Any], config: Config) -> list[str]:
    """`<key> <then> -> <now>` for each setting of what the run learns that differs from the checkpoint's run."""
    return [f"{key} {then!r} -> {now!r}" for key, then, now in _changes(written, config)
            if key not in OPERATIONAL_KEYS and not (key == "optim.lr_batch" and now is None)]  # None: the run's kept


def _powersgd_state(state: dict[str, Any], engine: Engine) -> dict[str, Any] | None:
    """The checkpoint's PowerSGD state where this run can go on with it: as many processes, the same
    matrices and ranks. Else its errors and factors start afresh, said in one line."""
    saved = state.get("powersgd")
    if engine.powersgd is None or (saved is not None and engine.powersgd.fits(saved)):
        return saved
    if saved is None:
        written = state.get("config", {}).get("train", {}).get("compression", "none")
        why = f"the checkpoint holds none (its run: --compression {written} on {state.get('world_size', 1)} process(es))"
    elif saved.get("world_size") != engine.size:
        why = f"the checkpoint was written by {saved.get('world_size')} processes and this run has {engine.size}"
    else:
        why = "the checkpoint's factors are of another train.powersgd_rank"
    say(f"hvdtrain: PowerSGD's error buffers and factors start afresh: {why}")
    return None


def _optimizer_state(saved: dict[str, Any], run: Run, config: Config) -> dict[str, Any]:
    """The saved optimizer state as this run's optimizer takes it: AdamW's from before its two groups split."""
    if config.optim.name != "adamw" or len(run.optimizer.param_groups) == 1:
        return saved
    return split_adamw_groups(saved, [p.dim() for p in unwrapped(run.model).parameters()])

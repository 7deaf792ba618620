"""Elastic training: processes may be lost or added while the run goes on.

    horovodrun --gloo -np 3 --min-np 2 --max-np 4 \
        --host-discovery-script launch/discover-hosts.sh hvdtrain fit --elastic

Horovod's elastic driver restarts the training function on every change of processes.
The state that survives a change is the model, the optimizer, and where the run is:
epoch, optimizer step and the global position within the epoch's sample order. It is
kept in memory every `train.commit_every` steps and after each epoch. After a lost
process the rest roll back to that commit; a new process gets it from rank 0. Then
the sampler hands out what remains of the epoch among the new set of ranks, so each
sample of an epoch is trained on once (work after the last commit is redone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdtrain.config import Config
from hvdtrain.engine import Engine
from hvdtrain.engine.base import ElasticState
from hvdtrain.errors import UserError
from hvdtrain.io.checkpoint import Start
from hvdtrain.io.progress import say
from hvdtrain.train.summary import Totals
from hvdtrain.train.trainer import Hooks, Trainer


def fit_elastic(config: Config, engine: Engine, started: float) -> dict[str, Any]:
    """`fit` for `--elastic`: the same epochs, inside Horovod's elastic loop."""
    engine.require_elastic()  # before anything is built or written
    if config.train.callbacks or config.train.early_stopping_patience is not None or config.train.sync_batchnorm:
        raise UserError("callbacks, early stopping and --sync-batchnorm do not run with --elastic yet: drop "
                        "--callback, --early-stopping-patience and --sync-batchnorm, or train without --elastic")
    # A process that joins later runs this too, while the others wait in their state
    # sync: no collective may happen before it, so set-up errors are held until then.
    trainer = Trainer(config, engine, started)
    error: Exception | None = None
    start = Start()
    try:
        trainer.prepare()  # the same checks as without --elastic
        start = trainer.start_on_root()
    except Exception as err:  # noqa: BLE001 - reported on every rank by settle
        error = err
    if error is not None:
        engine.settle("setup", error)  # dist: pairs with the first step of the others' sync; raises

    def before_sync() -> None:
        engine.settle("setup", None)
        with engine.agree("built_alike"):
            trainer.check_settings_alike()
            trainer.check_built_alike()

    run = trainer.run
    state = engine.elastic_state(
        run.model, run.optimizer, before_sync,
        epoch=start.epoch, step=start.step, position=start.position, run_dir=str(trainer.run_dir),
        scaler=run.precision.state_dict(), start_epoch=start.epoch, record=None, train_seconds=0.0, train_samples=0,
        lr_batch=start.lr_batch,
        stream_plan=start.stream_plan,  # a stream's epoch under way: its ranges are per process
    )
    attempts = _Attempts(trainer, started)
    with trainer.ending():
        return engine.run_elastic(attempts.train, state)


class _Attempts(Hooks):
    """Each attempt of the elastic loop, with the processes there are then; commits as hooks."""

    def __init__(self, trainer: Trainer, started: float):
        self.trainer, self.started = trainer, started
        self.sizes: list[int] = []  # the world size of each attempt
        self.state: Any = None
        trainer.hooks = self

    def train(self, state: ElasticState) -> dict[str, Any]:
        """One attempt: from the last commit to the end, with the processes there are now."""
        trainer, engine = self.trainer, self.trainer.engine
        self.state = state
        if self.sizes and engine.is_root:
            say(f"hvdtrain: elastic: {engine.size} processes now (were {self.sizes[-1]}); going on from epoch "
                f"{state.epoch + 1}, sample {state.position} of {len(trainer.run.split.train)} in its order")
        self.sizes.append(engine.size)
        trainer.reshard()
        trainer.run.precision.load_state_dict(state.scaler)
        start = Start(state.epoch, state.step, state.position, world_size=engine.size, lr_batch=state.lr_batch,
                      stream_plan=state.stream_plan)
        totals = Totals(self.started, state.start_epoch, record=state.record, train_seconds=state.train_seconds,
                        train_samples=state.train_samples)
        # dist: step numbers count steps of the current global batch, so the lr schedule
        # (warm-up, cosine) stays where the run is in samples when the world size changes.
        state.step = trainer.begin(Path(state.run_dir), start, totals)
        trainer.run_epochs(start, state.step)
        return trainer.finish()

    def after_step(self, step: int, done: int, position: int) -> None:
        state = self.state
        if done % self.trainer.config.train.commit_every == 0:
            state.step, state.position = step, position
            state.stream_plan = self.trainer.shard.sampler.state_at(position)
            self._commit()

    def after_epoch(self, epoch: int, step: int) -> None:
        state, totals = self.state, self.trainer.totals
        state.epoch, state.step, state.position, state.record = epoch, step, 0, totals.record
        state.stream_plan = None
        state.train_seconds, state.train_samples = totals.train_seconds, totals.train_samples
        self._commit()

    def _commit(self) -> None:
        """Keeps the current state in memory; raises when processes were added or removed."""
        self.state.scaler = self.trainer.run.precision.state_dict()
        self.state.commit()

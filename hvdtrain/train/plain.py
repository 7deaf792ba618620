"""`fit` without `--elastic`: every rank sets up together, starts from rank 0's weights, and runs
the epochs.

    horovodrun -np 2 hvdtrain fit             # two processes, Gloo or MPI
    mpirun -np 2 hvdtrain fit                 # the same through plain MPI
    hvdtrain fit                              # one process, no launcher needed
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdtrain.config import Config
from hvdtrain.engine import Engine
from hvdtrain.io.mlflow_log import require_mlflow
from hvdtrain.io.run_dir import TIMELINE
from hvdtrain.train.callbacks import HOOKS, Callbacks, StoppedEarly, build_callbacks
from hvdtrain.train.loggers import warn
from hvdtrain.models import unwrapped
from hvdtrain.train.stop_policy import StopPolicy, StopSignals
from hvdtrain.train.setup import make_data
from hvdtrain.train.summary import Totals
from hvdtrain.train.sync_batchnorm import synchronize_batchnorm
from hvdtrain.train.trainer import Trainer


def fit_plain(config: Config, engine: Engine, started: float) -> dict[str, Any]:
    """`fit` for a fixed set of processes."""
    # From the start, not the first epoch: a signal during set-up (Slurm's, a user's) is noted and
    # stops the run at its first step with a checkpoint, instead of killing the process.
    with StopSignals(config.run.stop_signals) as signals:
        trainer = Trainer(config, engine, started)
        with trainer.ending():
            trainer.callbacks = _set_up(trainer)
            return _train(trainer, signals, started)


def _set_up(trainer: Trainer) -> Callbacks:
    """Every check on every rank; returns the callbacks."""
    config, engine = trainer.config, trainer.engine
    # dist: what costs nothing first, so that a wrong setting or run directory costs no download. The
    # settings alike before any other collective: the ranks' data.in_turn decides which come next.
    with engine.agree("options"):
        trainer.check_settings_alike()
        if engine.is_root:
            trainer.check_run_dir()
        if config.run.horovod_timeline:
            engine.require_timeline()
        if config.run.mlflow:
            require_mlflow()
    made = engine.made_in_turn(lambda: make_data(config)) if config.data.in_turn else None  # dist: fetched once
    with engine.agree("setup"):  # dist: a failure on any rank stops all of them here
        trainer.prepare(made)
        callbacks = build_callbacks(config.train.callbacks, trainer.best, config.train.early_stopping_patience,
                                    config.train.early_stopping_min_delta)
    with engine.agree("built_alike"):
        trainer.check_built_alike()
    callbacks.settle(engine)
    never = callbacks.hooks_never_called()
    if engine.rank == 0 and never:
        more = f" and {len(never) - 4} more" if len(never) > 5 else ""
        warn(f"hvdtrain never calls {', '.join(never[:4] if more else never)}{more}: a callback's hooks are "
             f"{', '.join(HOOKS)} (see README, Callbacks)")
    if config.train.sync_batchnorm:  # dist: from here on a BatchNorm forward is a collective
        synchronize_batchnorm(unwrapped(trainer.run.model), engine)
    return callbacks


def _train(trainer: Trainer, signals: StopSignals, started: float) -> dict[str, Any]:
    """From rank 0's weights (and checkpoint), every epoch; returns the summary."""
    config, engine, run, callbacks = trainer.config, trainer.engine, trainer.run, trainer.callbacks
    with engine.agree("resume"):
        start = trainer.start_on_root()
    run_dir = Path(engine.broadcast_object(str(trainer.run_dir) if engine.is_root else None, "run_dir"))
    # dist: every rank starts from rank 0's weights and optimizer state (and gradient scaler).
    engine.broadcast_parameters(run.model)
    engine.broadcast_optimizer_state(run.optimizer, trainer.resumed_optimizer)
    trainer.resumed_optimizer = None  # rank 0's copy of the whole state: not kept for the run
    engine.broadcast_powersgd(trainer.resumed_powersgd)
    trainer.resumed_powersgd = None
    start = engine.broadcast_object(start, "start")
    run.precision.load_state_dict(engine.broadcast_object(run.precision.state_dict(), "scaler"))  # dist: fp16
    step = trainer.begin(run_dir, start, Totals(started, start.epoch))
    if config.run.horovod_timeline:
        engine.start_timeline(run_dir / TIMELINE)
    trainer.stops = StopPolicy(config.run, engine, signals, callbacks)
    callbacks.bind(engine, unwrapped(run.model), run_dir)
    if start.epoch and config.train.early_stopping_patience is not None:  # dist: rank 0 reads, all learn
        callbacks.resume_early_stopping(engine.broadcast_object(trainer.loggers.best_record(*trainer.best),
                                                                "early_stopping_best"))
    stopped = None
    try:
        callbacks.call("on_fit_start", start.epoch, step)
        trainer.run_epochs(start, step)
    except StoppedEarly as early:  # every rank, at the same step: an orderly end
        stopped = early
    except BaseException:
        trainer.loggers.close()  # a stop or a failure: TensorBoard's last events are written too
        raise
    if config.run.horovod_timeline:
        engine.stop_timeline()
    summary = trainer.finish(stopped)
    record = trainer.totals.record or {}
    callbacks.call("on_fit_end", record.get("epoch", start.epoch), record.get("step", step), record, summary)
    return summary

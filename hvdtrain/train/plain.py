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
from hvdtrain.io.checkpoint import CheckpointStore
from hvdtrain.io.progress import bar_stream
from hvdtrain.io.run_dir import TIMELINE
from hvdtrain.io.mlflow_log import require_mlflow
from hvdtrain.train.callbacks import StoppedEarly, build_callbacks
from hvdtrain.train.epoch import Totals, finish, open_run_files, run_epoch
from hvdtrain.train.preemption import StopSignals, StepCheck
from hvdtrain.train.sync_batchnorm import synchronize_batchnorm
from hvdtrain.train.setup import (build, check_same_data, check_task, keep_learning_rate, shard, start_on_root,
                                  unwrapped)


def fit_plain(config: Config, engine: Engine, started: float) -> dict[str, Any]:
    """`fit` for a fixed set of processes."""
    # From the start, not the first epoch: a signal during set-up (Slurm's, a user's) is noted and
    # stops the run at its first step with a checkpoint, instead of killing the process.
    with StopSignals(config.run.stop_signals) as signals:
        return _fit(config, engine, started, signals)


def _fit(config: Config, engine: Engine, started: float, signals: StopSignals) -> dict[str, Any]:
    with engine.agree("setup"):  # dist: a failure on any rank stops all of them here
        if config.run.horovod_timeline:
            engine.require_timeline()
        run = build(config, engine)
        shard(run, config, engine)
        check_task(run, config, engine)
        callbacks = build_callbacks(config.train.callbacks, run.best, config.train.early_stopping_patience,
                                    config.train.early_stopping_min_delta)
        if config.run.mlflow:
            require_mlflow()
    with engine.agree("data"):
        check_same_data(engine, run)
    callbacks.settle(engine)
    if config.train.sync_batchnorm:  # dist: from here on a BatchNorm forward is a collective
        synchronize_batchnorm(unwrapped(run.model), engine)
    with engine.agree("resume"):
        start = start_on_root(config, engine, run)
    run_dir = Path(engine.broadcast_object(str(run.run_dir) if engine.is_root else None, "run_dir"))
    # dist: every rank starts from rank 0's weights and optimizer state (and gradient scaler).
    engine.broadcast_parameters(run.model)
    engine.broadcast_optimizer_state(run.optimizer)
    start = engine.broadcast_object(start, "start")
    if start.lr_batch and config.optim.lr_batch is None:
        keep_learning_rate(config, start.lr_batch)
        shard(run, config, engine)  # dist: the learning rate for the run's own reference batch
    run.precision.load_state_dict(engine.broadcast_object(run.precision.state_dict(), "scaler"))  # dist: fp16
    # dist: steps count steps of this run's global batch: on another number of processes the
    # learning-rate schedule goes on from where the run is in samples, not from the old step count.
    per_step = run.train_sampler.global_batch * config.train.accumulate
    step = start.epoch * (len(run.train_sampler) // config.train.accumulate) + start.position // per_step

    totals = Totals(started, start.epoch)
    files = open_run_files(config, engine, run, run_dir, start.epoch, step)
    store = CheckpointStore(run_dir, config.run.keep_last, *run.best)
    stream = bar_stream(config.run.progress) if engine.is_root else None  # dist: rank 0 only
    if config.run.horovod_timeline:
        engine.start_timeline(run_dir / TIMELINE)
    check = StepCheck(config.run, engine, signals, callbacks)
    callbacks.bind(engine, unwrapped(run.model), run_dir)
    if start.epoch and config.train.early_stopping_patience is not None:  # dist: rank 0 reads, all learn
        callbacks.resume_early_stopping(engine.broadcast_object(
            files.best_record(*run.best) if files is not None else None, "early_stopping_best"))
    stopped = None
    try:
        callbacks.call("on_fit_start", start.epoch, step)
        for epoch in range(start.epoch + 1, config.train.epochs + 1):
            resumed = start if epoch == start.epoch + 1 and start.position else None
            step = run_epoch(run, config, engine, epoch, step, totals, files, store, stream,
                             start=resumed.position if resumed else 0, check=check, resumed=resumed,
                             callbacks=callbacks)
    except StoppedEarly as early:  # every rank, at the same step: an orderly end
        stopped = early
    except BaseException:
        if files is not None:  # a stop or a failure: TensorBoard's last events are written too
            files.close()
        raise
    if config.run.horovod_timeline:
        engine.stop_timeline()
    summary = finish(config, engine, run, run_dir, totals, files, stopped)
    record = totals.record or {}
    callbacks.call("on_fit_end", record.get("epoch", start.epoch), record.get("step", step), record, summary)
    return summary

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
from hvdtrain.train.epoch import Totals, finish, open_run_files, run_epoch
from hvdtrain.train.setup import build, check_same_data, check_task, shard, start_on_root


def fit_plain(config: Config, engine: Engine, started: float) -> dict[str, Any]:
    """`fit` for a fixed set of processes."""
    with engine.agree("setup"):  # dist: a failure on any rank stops all of them here
        if config.run.horovod_timeline:
            engine.require_timeline()
        run = build(config, engine)
        shard(run, config, engine)
        check_task(run, config, engine)
    with engine.agree("data"):
        check_same_data(engine, run)
    with engine.agree("resume"):
        start_epoch, step = start_on_root(config, engine, run)
    run_dir = Path(engine.broadcast_object(str(run.run_dir) if engine.is_root else None, "run_dir"))
    # dist: every rank starts from rank 0's weights and optimizer state.
    engine.broadcast_parameters(run.model)
    engine.broadcast_optimizer_state(run.optimizer)
    start_epoch, step = engine.broadcast_object((start_epoch, step), "start")

    totals = Totals(started, start_epoch)
    files = open_run_files(config, engine, run, run_dir, start_epoch, step)
    store = CheckpointStore(run_dir, config.run.keep_last, *run.best)
    stream = bar_stream(config.run.progress) if engine.is_root else None  # dist: rank 0 only
    if config.run.horovod_timeline:
        engine.start_timeline(run_dir / TIMELINE)
    for epoch in range(start_epoch + 1, config.train.epochs + 1):
        step = run_epoch(run, config, engine, epoch, step, totals, files, store, stream)
    if config.run.horovod_timeline:
        engine.stop_timeline()
    return finish(config, engine, run, run_dir, totals, files)

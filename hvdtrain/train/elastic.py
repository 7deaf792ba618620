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
from hvdtrain.data.stream_sampler import StreamBatchSampler
from hvdtrain.engine import Engine
from hvdtrain.engine.base import ElasticState
from hvdtrain.errors import UserError
from hvdtrain.io.checkpoint import CheckpointStore
from hvdtrain.io.progress import bar_stream, say
from hvdtrain.io.run_dir import RunFiles
from hvdtrain.train.epoch import Totals, finish, open_run_files, run_epoch
from hvdtrain.train.setup import Run, build, check_same_data, check_task, keep_learning_rate, shard, start_on_root


def fit_elastic(config: Config, engine: Engine, started: float) -> dict[str, Any]:
    """`fit` for `--elastic`: the same epochs, inside Horovod's elastic loop."""
    engine.require_elastic()  # before anything is built or written
    if config.train.callbacks or config.train.early_stopping_patience is not None or config.train.sync_batchnorm:
        raise UserError("callbacks, early stopping and --sync-batchnorm do not run with --elastic yet: drop "
                        "--callback, --early-stopping-patience and --sync-batchnorm, or train without --elastic")
    # A process that joins later runs this too, while the others wait in their state
    # sync: no collective may happen before it, so set-up errors are held until then.
    error: Exception | None = None
    run: Run | None = None
    start_epoch = step = position = lr_batch = 0
    stream_plan = None
    try:
        run = build(config, engine)
        shard(run, config, engine)  # the same checks as without --elastic
        check_task(run, config, engine)
        start = start_on_root(config, engine, run)
        start_epoch, step, position, lr_batch = start.epoch, start.step, start.position, start.lr_batch
        stream_plan = start.stream_plan
    except Exception as err:  # noqa: BLE001 - reported on every rank by settle
        error = err
    if error is not None:
        engine.settle("setup", error)  # dist: pairs with the first step of the others' sync; raises

    def before_sync() -> None:
        engine.settle("setup", None)
        with engine.agree("data"):
            check_same_data(engine, run)

    state = engine.elastic_state(
        run.model, run.optimizer, before_sync,
        epoch=start_epoch, step=step, position=position, run_dir=str(run.run_dir), scaler=run.precision.state_dict(),
        start_epoch=start_epoch, record=None, train_seconds=0.0, train_samples=0, lr_batch=lr_batch,
        stream_plan=stream_plan,  # a stream's epoch under way: its ranges are per process (StreamBatchSampler)
    )
    sizes: list[int] = []  # the world size of each attempt
    opened: list[RunFiles] = []  # rank 0's run files of the attempt under way
    return engine.run_elastic(lambda current: _train(current, run, config, engine, started, sizes, opened), state)


def _train(state: ElasticState, run: Run, config: Config, engine: Engine, started: float,
           sizes: list[int], opened: list[RunFiles]) -> dict[str, Any]:
    """One attempt: from the last commit to the end, with the processes there are now."""
    if sizes and engine.is_root:
        say(f"hvdtrain: elastic: {engine.size} processes now (were {sizes[-1]}); going on from epoch "
            f"{state.epoch + 1}, sample {state.position} of {len(run.split.train)} in its order")
    sizes.append(engine.size)
    keep_learning_rate(config, state.lr_batch)  # dist: rank 0's checkpoint's, on every rank
    shard(run, config, engine)
    run.precision.load_state_dict(state.scaler)
    per_step = run.train_sampler.global_batch * config.train.accumulate
    steps_per_epoch = len(run.train_sampler) // config.train.accumulate
    # dist: step numbers count steps of the current global batch, so the lr schedule
    # (warm-up, cosine) stays where the run is in samples when the world size changes.
    state.step = state.epoch * steps_per_epoch + state.position // per_step
    run_dir = Path(state.run_dir)
    totals = Totals(started, state.start_epoch, record=state.record,
                    train_seconds=state.train_seconds, train_samples=state.train_samples)
    for previous in opened:  # an attempt that a change of processes ended: its TensorBoard writer too
        previous.close()
    opened.clear()
    files = open_run_files(config, engine, run, run_dir, state.epoch, state.step)
    if files is not None:
        opened.append(files)
    store = CheckpointStore(run_dir, config.run.keep_last, *run.best)
    stream = bar_stream(config.run.progress) if engine.is_root else None
    for epoch in range(state.epoch + 1, config.train.epochs + 1):
        first_step, first_position = state.step, state.position

        def after_step(step: int) -> None:
            if (step - first_step) % config.train.commit_every == 0:
                state.step, state.position = step, first_position + (step - first_step) * per_step
                if isinstance(run.train_sampler, StreamBatchSampler):
                    state.stream_plan = run.train_sampler.plan_state(state.position)
                commit(state, run)

        step = run_epoch(run, config, engine, epoch, state.step, totals, files, store, stream,
                         start=state.position, after_step=after_step, stream_plan=state.stream_plan)
        state.epoch, state.step, state.position, state.record = epoch, step, 0, totals.record
        state.stream_plan = None
        state.train_seconds, state.train_samples = totals.train_seconds, totals.train_samples
        commit(state, run)
    return finish(config, engine, run, run_dir, totals, files)


def commit(state: ElasticState, run: Run) -> None:
    """Keeps the current state in memory; raises when processes were added or removed."""
    state.scaler = run.precision.state_dict()
    state.commit()

"""The distributed engines: choosing and starting one, and the rank facts known before it starts.

`base` is the interface the loop speaks to; `local`, `horovod` (the only importer of horovod.torch) and
`torch_distributed` (the only one to set up a process group) implement it, the last two over
`watched` (collectives the stall watchdog can name); `buckets` combines gradients while backward runs,
`sharded` shards the optimizer state; `environment` reads the launchers' variables, `watchdog` names
stalled ranks. Imports only `errors` and `startup_gc` of hvdtrain.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Iterator

import torch

from hvdtrain import startup_gc
from hvdtrain.engine import host_memory
from hvdtrain.engine.base import Engine, GradientSync, RankFailed
from hvdtrain.engine.environment import (available_cores, env_rendezvous_launched, environment_rank, launcher_facts,
                                         plain_srun_rank, threads_per_process, too_many_threads, torchrun_launched)
from hvdtrain.engine.local import LocalEngine
from hvdtrain.errors import AnotherRankFailed, StoppedBySignal, UserError

__all__ = ["Engine", "GradientSync", "LocalEngine", "RankFailed", "available_cores", "launcher_rank", "running_engine",
           "start_engine"]

_started: Engine | None = None  # the Horovod engine, once started


def launcher_rank() -> int | None:
    """This process's rank, or None when no launcher started it.

    Known from the launcher before any engine starts, so that only rank 0 reports a
    bad command line; from the engine once it runs (elastic training renumbers ranks).
    """
    if _started is not None:
        try:
            return _started.rank
        except ValueError:  # Horovod has shut down
            pass
    return environment_rank()


def start_engine(kind: str = "auto", device: str = "auto", threads: int = 0, stall_timeout: int = 300,
                 keep_freed_memory: bool = True, timeline: bool = False, process_goes_on: bool = True,
                 env_rendezvous: bool = False) -> Engine:
    """Starts torch.distributed under torchrun, Horovod when another launcher started us (or
    when asked), else a local engine.

    dist: sets this process's device (cuda:<local rank>) and thread count (cores
    divided among the processes on this host) before any tensor work. `process_goes_on`: the
    process may start an engine again after this one; False for the `hvdtrain` command's own
    process, which ends with its command. `env_rendezvous`: torch's env:// variables without a launcher
    make a job of the torch engine (fit's; other commands run alone).
    """
    if keep_freed_memory:
        host_memory.keep_freed_memory()
    from hvdtrain.engine.torch_distributed import TorchEngine

    _refuse_a_mismatch(kind)
    plain_srun = plain_srun_rank() is not None
    # dist: Slurm's own variables are all that plain srun gives; the torch engine reads them.
    env_job = env_rendezvous and env_rendezvous_launched()
    if kind == "torch" or (kind == "auto" and (torchrun_launched() or plain_srun or env_job)):
        return _start(TorchEngine, device, threads, stall_timeout)
    if kind == "horovod" or (kind == "auto" and launcher_rank() is not None):
        from hvdtrain.engine.horovod import HorovodEngine  # imports horovod.torch

        HorovodEngine.init(stall_timeout, timeline, keep_mpi=process_goes_on)
        return _start(HorovodEngine, device, threads, stall_timeout)
    engine_device = _pick_device(device, local_rank=0, local_size=1)
    torch.set_num_threads(threads_per_process(threads, local_size=1))
    return LocalEngine(engine_device)


def _refuse_a_mismatch(kind: str) -> None:
    """An engine asked for that cannot join the processes the launcher started is one line saying what
    to use: each process would otherwise be a run of its own, all in one run directory."""
    if kind not in ("local", "torch", "horovod"):
        return
    facts = launcher_facts()
    size = facts[1] if facts else 1
    if kind == "local" and env_rendezvous_launched():
        raise UserError(f"--engine local trains in one process alone, but RANK, WORLD_SIZE={size}, MASTER_ADDR and "
                        "MASTER_PORT (torch's env:// rendezvous) make this one of a job: leave --engine out, or "
                        "unset them to train alone")
    if kind == "local" and size > 1:
        raise UserError(f"--engine local trains in one process alone, but {size} were started: leave --engine out "
                        "to train them as one job, or start one process")
    if kind == "torch" and os.environ.get("HOROVOD_ELASTIC") == "1":
        raise UserError("horovodrun's elastic mode adds and replaces processes, which the torch engine's fixed "
                        "process group cannot follow: leave --engine out (Horovod), or drop horovodrun's elastic "
                        "options")
    if kind == "horovod" and torchrun_launched() and size > 1:
        raise UserError(f"torchrun started {size} processes, which the Horovod engine cannot join: --engine torch "
                        "(or leave --engine out), or start them with horovodrun or mpirun")
    if kind == "horovod" and env_rendezvous_launched():
        raise UserError(f"WORLD_SIZE={size} with MASTER_ADDR and MASTER_PORT is torch's env:// rendezvous, which the "
                        "Horovod engine cannot join: --engine torch (or leave --engine out), or start the processes "
                        "with horovodrun or mpirun")
    if kind == "horovod" and plain_srun_rank() is not None:
        raise UserError(f"srun started {os.environ['SLURM_STEP_NUM_TASKS']} tasks without an MPI plugin, which the "
                        "Horovod engine needs: srun --mpi=pmix (as launch/slurm.sbatch does), or --engine torch")


@contextlib.contextmanager
def running_engine(on_failure: Callable[[Exception], None] | None = None, **engine_args: Any) -> Iterator[Engine]:
    """The engine started (`start_engine`'s arguments) for the work inside, and shut down after it.

    `on_failure(err)` sees a failure before the engine shuts down (it may exit): launchers stop
    the other ranks as soon as one exits, and rank 0 must have said why by then.
    """
    engine = start_engine(**engine_args)
    startup_gc.settle()  # torch and Horovod are in: the collector runs again, past what they made
    others = engine.size > 1
    finished = False
    deadline: threading.Timer | None = None
    try:
        yield engine
        finished = True
    except Exception as err:
        # Stopped by a signal, every rank at the same step: as orderly an end as a finished run.
        finished = isinstance(err, StoppedBySignal)
        if on_failure is not None:
            try:
                on_failure(err)
            except SystemExit as leaving:
                if not finished and others and not engine_args.get("process_goes_on"):
                    deadline = _leave_by_a_deadline(leaving.code if isinstance(leaving.code, int) else 1)
                raise
        elif others and engine.is_engine_signal(err):  # a script's: one exception that says so, not the engine's
            raise AnotherRankFailed.of(err) from err
        raise
    finally:
        engine.shutdown(finished)
        if deadline is not None:  # shut down: the exit handlers that follow take the time they need
            deadline.cancel()


# A rank leaving on a failure, its line said, ends its engine's shutdown within this long: Horovod's waits
# for every rank (MPI_Finalize), and a rank can deadlock inside Horovod (its main thread, holding Python's
# lock, enqueues a collective while Horovod's thread, finalizing on the failure, waits for that lock), where
# no watchdog of Python's runs and the job would wait for ever. This rank's exit lets the launcher end the
# rest. Well above an ordinary failure's shutdown, which waits out the other ranks' 3 s for the launcher.
FAILED_SHUTDOWN_SECONDS = 15.0


def _leave_by_a_deadline(status: int) -> threading.Timer:
    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    timer = threading.Timer(FAILED_SHUTDOWN_SECONDS, leave)
    timer.daemon = True
    timer.start()
    return timer


def _start(engine_type: Any, device: str, threads: int, stall_timeout: int) -> Engine:
    local_rank, local_size = engine_type.local_facts()
    engine_device = _pick_device(device, local_rank, local_size)
    torch.set_num_threads(threads_per_process(threads, local_size))
    global _started
    _started = engine_type.start(engine_device, stall_timeout)
    crowded = too_many_threads(threads, local_size) if engine_device.type == "cpu" else None
    if crowded and local_rank == 0:  # dist: one line per host (per pod, each with its log)
        print(f"hvdtrain: warning: {crowded}", file=sys.stderr, flush=True)
    _started.watch(stall_timeout, elastic=os.environ.get("HOROVOD_ELASTIC") == "1")  # dist
    return _started


def _pick_device(kind: str, local_rank: int, local_size: int) -> torch.device:
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("train.device is cuda but no GPU is visible: use --device cpu, or check CUDA_VISIBLE_DEVICES")
    visible = torch.cuda.device_count()
    if local_size > visible:
        raise UserError(
            f"{local_size} processes on this host but only {visible} visible GPU(s): "
            f"start at most {visible} processes per host, or use --device cpu"
        )
    # dist: one process per GPU; the index is among the devices CUDA_VISIBLE_DEVICES leaves visible.
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)

"""`hvdtrain doctor`: what this machine offers a launch, and what is missing, with the fix.

Alone it describes this host for `--np` planned local processes; under horovodrun,
mpirun or torchrun every rank reports and rank 0 prints them in rank order. Both
engines are checked: Horovod's build, and torch.distributed's backends.
"""

from __future__ import annotations

import os
import platform
import shutil
from typing import Any

import torch

from hvdtrain.engine.environment import available_cores


def horovod_build() -> dict[str, Any]:
    """Horovod's version and what it was built with (no init needed)."""
    try:
        import horovod
        import horovod.torch as hvd
    except ImportError as err:
        return {"installed": False, "error": str(err)}
    return {
        "installed": True, "version": horovod.__version__,
        "frameworks": ["pytorch"],
        "controllers": [name for name, built in (("mpi", hvd.mpi_built()), ("gloo", hvd.gloo_built())) if built],
        "operations": [name for name, built in (("nccl", hvd.nccl_built()), ("mpi", hvd.mpi_built()),
                                                ("gloo", hvd.gloo_built()), ("ccl", hvd.ccl_built()),
                                                ("ddl", hvd.ddl_built())) if built],
        "cuda": bool(hvd.cuda_built()),
    }


def torch_distributed() -> dict[str, Any]:
    """The process-group backends this torch build has (the torch engine's)."""
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False, "backends": []}
    return {"available": True, "backends": [name for name, built in (
        ("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()), ("mpi", dist.is_mpi_available()))
        if built]}


def mpi_library() -> dict[str, Any]:
    """The MPI library behind mpi4py, read without initialising MPI (safe under any launcher)."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # MPI_Init would bind this process to an MPI job
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError as err:
        return {"mpi4py": None, "error": str(err)}
    return {"mpi4py": mpi4py.__version__, "standard": "{}.{}".format(*MPI.Get_version()),
            "library": MPI.Get_library_version().strip().splitlines()[0]}


def gpus(local_ranks: range) -> dict[str, Any]:
    """Visible GPUs, their physical ids, and which one each local rank takes."""
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    physical = [p.strip() for p in visible_env.split(",")] if visible_env else [str(i) for i in range(count)]
    devices = [{"index": i, "physical": physical[i] if i < len(physical) else "?",
                "name": torch.cuda.get_device_name(i)} for i in range(count)]
    # dist: local rank r uses cuda:r, an index among the visible devices, not a physical id.
    plan = {r: (f"cuda:{r} (physical {physical[r] if r < len(physical) else '?'})" if r < count else None)
            for r in local_ranks}
    return {"cuda_visible_devices": visible_env, "count": count, "devices": devices, "local_rank_gpu": plan}


def report(rank: int, local_rank: int, size: int, local_size: int, launched: bool,
           engine: str | None = None) -> dict[str, Any]:
    """This process's facts; alone, the GPU plan covers every planned local rank. `engine`: the one
    running this report under a launcher."""
    cores = available_cores()
    return {
        "rank": rank, "local_rank": local_rank, "size": size, "local_size": local_size,
        "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "engine": engine, "horovod": horovod_build(), "torch_distributed": torch_distributed(), "mpi": mpi_library(),
        "gpus": gpus(range(local_rank, local_rank + 1) if launched else range(local_size)),
        "cpu_cores": cores, "threads_per_rank": max(1, cores // max(1, local_size)),
        "launchers": {name: shutil.which(name) for name in ("horovodrun", "mpirun", "torchrun")},
    }


ENGINES = ("horovod", "torch")


def _wants_gpu(facts: dict[str, Any], device: str) -> bool:
    return device == "cuda" or (device == "auto" and facts["gpus"]["count"] > 0)


def engine_problems(facts: dict[str, Any], device: str) -> dict[str, list[str]]:
    """What would stop a launch with each engine, each with its fix."""
    wants_gpu = _wants_gpu(facts, device)
    horovod, found = facts["horovod"], {name: [] for name in ENGINES}
    if not horovod["installed"]:
        found["horovod"].append("Horovod does not import: run launch/install.sh (make demo does it)")
    else:
        if "gloo" not in horovod["controllers"] and "mpi" not in horovod["controllers"]:
            found["horovod"].append("Horovod has neither Gloo nor MPI built in: rebuild it with launch/install.sh")
        if wants_gpu and not horovod["cuda"]:
            found["horovod"].append("GPUs are visible but Horovod was built without CUDA/NCCL: launch/install.sh --gpu")
    if not facts["launchers"]["horovodrun"]:
        found["horovod"].append("horovodrun is not on PATH: source .venv/bin/activate (or run launch/install.sh)")
    if facts["mpi"].get("mpi4py") and not facts["launchers"]["mpirun"]:
        found["horovod"].append("mpirun is not on PATH: apt-get install openmpi-bin, or use horovodrun --gloo")
    backends = facts["torch_distributed"]["backends"]
    needed = "nccl" if wants_gpu else "gloo"
    if needed not in backends:
        found["torch"].append(f"this torch build has no {needed} backend ({', '.join(backends) or 'none'}): "
                              f"install a torch wheel with it{' (a CUDA build)' if needed == 'nccl' else ''}")
    if not facts["launchers"]["torchrun"]:
        found["torch"].append("torchrun is not on PATH: source .venv/bin/activate (or run launch/install.sh)")
    return found


def problems(facts: dict[str, Any], device: str, engine: str = "auto") -> list[str]:
    """What would stop a launch, each with its fix: for the engine asked for, the one running this
    report, or (auto, alone) only when neither engine could run."""
    found = []
    if _wants_gpu(facts, device) and facts["local_size"] > facts["gpus"]["count"]:
        found.append(f"{facts['local_size']} local processes but {facts['gpus']['count']} visible GPU(s): "
                     "start one process per GPU, or use --device cpu")
    per_engine = engine_problems(facts, device)
    engine = facts.get("engine") or engine
    if engine in per_engine:
        return found + per_engine[engine]
    if all(per_engine.values()):  # neither engine can run
        return found + [issue for name in ENGINES for issue in per_engine[name]]
    return found


def render(facts: dict[str, Any], issues: list[str], device: str = "auto") -> str:
    horovod, mpi, gpu = facts["horovod"], facts["mpi"], facts["gpus"]
    lines = [f"rank {facts['rank']}/{facts['size']}  local rank {facts['local_rank']}/{facts['local_size']}  "
             f"host {facts['host']}",
             f"  python {facts['python']}, torch {facts['torch']} (CUDA {facts['torch_cuda'] or 'none'})"]
    if horovod["installed"]:
        lines.append(f"  horovod {horovod['version']}: controllers {', '.join(horovod['controllers']) or 'none'}; "
                     f"operations {', '.join(horovod['operations']) or 'none'}; CUDA {'yes' if horovod['cuda'] else 'no'}")
    else:
        lines.append(f"  horovod: not importable ({horovod['error']})")
    backends = facts["torch_distributed"]["backends"]
    lines.append(f"  torch.distributed: backends {', '.join(backends) or 'none'}")
    for name, missing in engine_problems(facts, device).items():
        running = " (running this report)" if facts.get("engine") == name else ""
        lines.append(f"  engine {name}{running}: " + ("ready" if not missing else f"not ready: {missing[0]}"))
    lines.append(f"  MPI: {mpi['library']} (MPI {mpi['standard']}, mpi4py {mpi['mpi4py']})" if mpi.get("mpi4py")
                 else f"  MPI: mpi4py not importable ({mpi.get('error')})")
    lines.append(f"  GPUs visible: {gpu['count']} (CUDA_VISIBLE_DEVICES={gpu['cuda_visible_devices'] or 'unset'})")
    for device in gpu["devices"]:
        lines.append(f"    cuda:{device['index']} = physical GPU {device['physical']}: {device['name']}")
    for local_rank, choice in gpu["local_rank_gpu"].items():
        lines.append(f"  local rank {local_rank} -> {choice or 'cpu (no GPU for it)'}, {facts['threads_per_rank']} torch thread(s)")
    lines.append(f"  CPU cores: {facts['cpu_cores']}")
    lines.append(f"  launchers: " + ", ".join(f"{k} {v or 'missing'}" for k, v in facts["launchers"].items()))
    lines += [f"  PROBLEM: {issue}" for issue in issues] or ["  ok: ready to launch"]
    return "\n".join(lines)

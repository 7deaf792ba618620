"""What the launchers tell a process through its environment, read in this one place: rank and size
from horovodrun, mpirun (Open MPI), PMI/PMIx, torchrun and Slurm's srun; local rank and size (Slurm's
per-node task lists); the step's first node and a port per job; the cores this process may use.

    torchrun   RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE (and TORCHELASTIC_RUN_ID)
    env://     RANK WORLD_SIZE MASTER_ADDR MASTER_PORT, no launcher (by hand; a PyTorchJob's pods)
    mpirun     OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
    horovodrun HOROVOD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (with --gloo, nothing of MPI's)
    srun       SLURM_PROCID SLURM_STEP_NUM_TASKS SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE; PMI_RANK/PMIX_RANK with --mpi

Plain functions of `os.environ`, no torch: importable by anything.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

# (rank, world size, local rank, local size) as each launcher names them.
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
OPEN_MPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
HOROVODRUN = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")  # --gloo sets only these
# The step's own task count: a batch script has none (it is one process, whatever its allocation's
# SLURM_NTASKS), and salloc's shell step passes the allocation's SLURM_NTASKS on to its one task.
SLURM = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")  # else _slurm_tasks_here
# horovodrun's before Open MPI's: horovodrun --gloo passes on its own environment, which may hold an
# mpirun's of one process (what Horovod reads too, HOROVOD_RANK first).
_LAUNCHER_VARIABLES = (TORCHRUN, HOROVODRUN, OPEN_MPI, SLURM)
# Rank variables set by the launchers that start Horovod, in the order we trust them.
_MPI_RANK_VARIABLES = ("HOROVOD_RANK", OPEN_MPI[0], "PMI_RANK", "PMIX_RANK")


def torchrun_launched() -> bool:
    """torchrun (torch.distributed.run) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


# torch's env:// rendezvous, as a process started without a launcher gets it: by hand, or one per pod
# of a Kubernetes PyTorchJob, which sets these four (and no LOCAL_RANK: one process per pod).
ENV_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_rendezvous_launched() -> bool:
    """Started without a launcher, with torch's env:// variables for a job of several processes (a rank in
    range of a world size above 1). Only `fit` joins such a job: the other commands run alone (a shell in
    a PyTorchJob's pod has the variables too)."""
    if torchrun_launched() or mpi_rank() is not None or plain_srun_rank() is not None:
        return False
    if not all(os.environ.get(name, "").strip() for name in ENV_RENDEZVOUS):
        return False
    rank, size = os.environ["RANK"].strip(), os.environ["WORLD_SIZE"].strip()
    return rank.isdigit() and size.isdigit() and int(size) > 1 and int(rank) < int(size)


def torchrun_restarts() -> int:
    """How many times torchrun (--max-restarts) has started this job's workers again; 0 on the first start."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if torchrun_launched() else "0"
    return int(count) if count.isdigit() else 0


def launcher_ends_the_job_on_a_failure() -> bool:
    """Whether the launcher stops every process once one exits with a failure: torchrun's agent,
    horovodrun and Open MPI's mpirun do; srun does only when told to (--kill-on-bad-exit), and
    horovodrun's elastic driver not at all (it carries on without a failed worker)."""
    horovodrun = "HOROVOD_RANK" in os.environ and os.environ.get("HOROVOD_ELASTIC") != "1"
    return torchrun_launched() or horovodrun or OPEN_MPI[0] in os.environ


def environment_rank() -> int | None:
    """This process's rank as its launcher set it, or None when no launcher started it."""
    if torchrun_launched() and TORCHRUN[0] in os.environ:
        return int(os.environ[TORCHRUN[0]])
    mpi = mpi_rank()
    return mpi if mpi is not None else plain_srun_rank()


def mpi_rank() -> int | None:
    """The rank that horovodrun, mpirun or an MPI plugin of srun (PMI, PMIx) set."""
    for name in _MPI_RANK_VARIABLES:
        if name in os.environ:
            try:
                return int(os.environ[name])
            except ValueError:
                return None
    return None


def plain_srun_rank() -> int | None:
    """Slurm's task number in an srun step of several tasks that no MPI plugin set up
    (`srun -n 4 hvdtrain fit`). Not in a batch script itself: it has SLURM_PROCID but no step."""
    try:
        tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "0"))
        return int(os.environ[SLURM[0]]) if tasks > 1 and mpi_rank() is None else None
    except (KeyError, ValueError):
        return None


def launcher_facts() -> tuple[int, int, int, int] | None:
    """(rank, size, local rank, local size) from the launcher's environment; None without one."""
    for names in _LAUNCHER_VARIABLES:
        if names is TORCHRUN and not (torchrun_launched() or env_rendezvous_launched()):
            continue  # RANK and WORLD_SIZE left in the environment, under another launcher
        if all(name in os.environ for name in names[:2]):
            rank, size = _number(names[0]), _number(names[1])
            if names is TORCHRUN and names[2] not in os.environ and env_rendezvous_launched():
                # dist: without LOCAL_RANK, every process on this host where rank 0 is at a loopback address,
                # else the one process on its host (a PyTorchJob's pod)
                loopback = os.environ["MASTER_ADDR"].strip() in ("localhost", "::1") or \
                    os.environ["MASTER_ADDR"].strip().startswith("127.")
                return (rank, size, rank, size) if loopback else (rank, size, 0, 1)
            local_rank = _number(names[2]) if names[2] in os.environ else rank
            given = _number(names[3]) if names[3] in os.environ else None
            if names is SLURM:  # dist: SLURM_NTASKS_PER_NODE is the allocation's (srun -n 2 in
                local_size = _slurm_tasks_here() or given  # --ntasks-per-node=4 gave 4); the list is the step's
            else:
                local_size = given or _slurm_tasks_here()
            return rank, size, local_rank, local_size or size
    return None


def _number(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        from hvdtrain.errors import UserError

        raise UserError(f"{name}={value!r} in the environment is not a number: launchers set it to one; unset it, "
                        "or start the processes with the launcher again") from None


def _slurm_tasks_here() -> int | None:
    """Tasks of this Slurm step on this node, from its per-node list ("2(x3),1": 2 on each of the first
    three nodes, 1 on the fourth), which srun sets even without --ntasks-per-node."""
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    node = os.environ.get("SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            return None
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def slurm_first_node() -> str | None:
    """The first node of this Slurm step (where its task 0 runs), as `scontrol show hostnames` expands
    the compressed list ("node[01-04]"); None outside a step or without scontrol."""
    nodes = os.environ.get("SLURM_STEP_NODELIST")
    if not nodes:
        return None
    try:
        shown = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = shown.stdout.split()
    return first[0] if shown.returncode == 0 and first else None


# Where port_for_job picks: from torchrun's 29500 up to below Linux's default ephemeral ports (32768
# on): any outgoing connection on the host may hold one of those, and rank 0 could not listen there.
# A prime count: Open MPI's job ids are multiples of 65536 plus 1, and 3000 gave them 375 ports.
JOB_PORTS = (29500, 2999)


def port_for_job() -> int:
    """The same port on every rank of one job, different across jobs: Open MPI's job id, the port of
    horovodrun --gloo's own rendezvous (one a run), or Slurm's job and step ids (two steps of one
    allocation may run at once on one node)."""
    horovodrun_gloo = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT") if "HOROVOD_RANK" in os.environ else None
    launcher_s = horovodrun_gloo or os.environ.get("OMPI_MCA_ess_base_jobid")
    job = launcher_s or os.environ.get("SLURM_JOB_ID") or "0"
    digits = "".join(c for c in job if c.isdigit()) or "0"
    step = os.environ.get("SLURM_STEP_ID", "0") if not launcher_s else "0"
    # 7919 is prime to 2999: the steps of one job (and the jobs of one step number) get distinct ports.
    first, count = JOB_PORTS
    return first + (int(digits) + 7919 * (int(step) if step.isdigit() else 0)) % count


def srun_step_left_waiting() -> str | None:
    """`JOB.STEP` of the srun step of several tasks this process is one of, where no launcher of its
    own ends the other tasks when this one fails (srun does only with --kill-on-bad-exit); None
    elsewhere."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    try:
        several = int(os.environ.get("SLURM_STEP_NUM_TASKS", "0")) > 1
    except ValueError:
        return None
    if not (job and step and several) or launcher_ends_the_job_on_a_failure():
        return None
    return f"{job}.{step}"


def end_srun_step(step: str) -> None:
    """Sends the tasks of srun step `step` SIGTERM, which ends them while they start (its default
    action); this process, which is leaving with its own status, ignores it. Not a cancel: Slurm
    would SIGKILL this process too, and srun report every task killed."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        subprocess.run(["scancel", "--quiet", "--signal=TERM", step], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass  # no scancel here: the others wait out the rendezvous timeout, and say so


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which launchers and containers narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_process(requested: int, local_size: int) -> int:
    """--threads where given; else the user's OMP_NUM_THREADS; else this rank's share of the host's cores.
    dist: ranks on one host share its cores; more threads than cores slows every rank."""
    if requested > 0:
        return requested
    return users_thread_count() or max(1, available_cores() // max(1, local_size))


def too_many_threads(requested: int, local_size: int) -> str | None:
    """The warning for threads per process (--threads, OMP_NUM_THREADS) that this host's ranks cannot all
    run at once: threads then wait for cores, and every step for the slowest (half the speed, 8 threads each
    for 2 processes on 2 cores). The cores are this rank's own where the launcher bound each rank to some
    (mpirun's --bind-to core), else the ones all of the host's ranks share (a container's, or the host's).
    None where they fit, or for one thread each, which is as few as there can be."""
    threads = threads_per_process(requested, local_size)
    mine, shared = available_cores(), len(_cgroup_cpus()) or (os.cpu_count() or 1)
    bound = mine < shared
    if threads == 1 or (threads <= mine if bound else threads * local_size <= mine):
        return None
    given = f"--threads {requested}" if requested > 0 else f"OMP_NUM_THREADS={threads}"
    fits = max(1, mine if bound else mine // max(1, local_size))
    where = f"the {mine} core{'s' if mine > 1 else ''} each process is bound to" if bound else \
        f"{mine} core{'s' if mine > 1 else ''} for {local_size} process{'es' if local_size > 1 else ''}"
    return f"{threads} threads per process ({given}) on {where}: threads wait for cores and every step slows; " \
           f"give --threads {fits}"


def _cgroup_cpus() -> set[int]:
    """The CPUs of this process's cgroup (v2's cpuset.cpus.effective: a container's, a Slurm job's); empty
    where it cannot be read."""
    try:
        text = Path("/sys/fs/cgroup/cpuset.cpus.effective").read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        if first.isdigit() and (last or first).isdigit():
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def users_thread_count() -> int | None:
    """OMP_NUM_THREADS as the user set it; None where unset or not a count, and under torchrun where it is
    1, which torchrun sets itself for several processes per host unless the user did."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value.isdigit() or int(value) < 1 or (value == "1" and torchrun_launched()):
        return None
    return int(value)

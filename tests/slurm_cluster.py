"""A one-node Slurm cluster on this machine for the tests: munged, slurmctld and slurmd from
Debian's packages, each with its own config, ports, spool and logs in a temporary directory.

    with slurm_cluster(tmp_path) as env:
        subprocess.run(["sbatch", "--wait", "launch/slurm.sbatch"], env=env)

Needs root (slurmd runs tasks as the submitting user and manages their processes).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

from conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


def available() -> str | None:
    """Why a local cluster cannot run here; None when it can."""
    missing = [name for name in (*DAEMONS, "sbatch", "scancel", "squeue") if shutil.which(name, path=_sbin_path()) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install slurmd slurmctld munge slurm-client)"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root"
    return None


def _sbin_path() -> str:
    return f"/usr/sbin:/usr/bin:{os.environ.get('PATH', '')}"


def _node_line() -> str:
    """This machine's CPUs and memory as slurmd sees them, named localhost (its real name is not)."""
    found = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True,
                           env={**os.environ, "PATH": _sbin_path()}).stdout.splitlines()[0]
    fields = dict(part.split("=", 1) for part in found.split() if "=" in part)
    memory = max(1, int(fields.get("RealMemory", "1024")) - 512)
    return (f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={fields['CPUs']} Boards={fields.get('Boards', 1)} "
            f"SocketsPerBoard={fields['SocketsPerBoard']} CoresPerSocket={fields['CoresPerSocket']} "
            f"ThreadsPerCore={fields['ThreadsPerCore']} RealMemory={memory} State=UNKNOWN")


def write_config(root: Path) -> dict[str, str]:
    """The cluster's files under `root`; returns the environment its commands need."""
    for sub in ("munge", "state", "spool", "log", "pids", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # munge's socket directory must be reachable by every user
    os.chmod(root / "munge", 0o755)
    os.chmod(root / "tmp", 0o1777)  # like /tmp: the job's user makes its PMIx directory here
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    socket_path = root / "munge" / "munge.socket"
    ctld, slurmd = free_port(), free_port()
    (root / "slurm.conf").write_text("\n".join([
        "ClusterName=hvdtrain-test",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld}",
        f"SlurmdPort={slurmd}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={socket_path}",
        "CredType=cred/munge",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        # PMIx makes each step's spmix_appdir_<uid>_<job>.<step> here (default /tmp) and fails the
        # step if it exists: one left by a killed step of an earlier cluster, whose job ids also
        # started at 1, would fail this cluster's job of the same id ("task 0 launch failed").
        f"TmpFS={root / 'tmp'}",
        f"SlurmctldPidFile={root / 'pids' / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'pids' / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerType=sched/builtin",
        "KillWait=5",
        _node_line(),
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        "",
    ]))
    return {"SLURM_CONF": str(root / "slurm.conf"), "PATH": _sbin_path()}


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Starts munged, slurmctld and slurmd; yields the environment for sbatch and friends; stops them."""
    settings = write_config(root)
    env = {**os.environ, **settings}
    munge = root / "munge"
    log = root / "log"

    def start(*command: str) -> subprocess.Popen:
        with open(log / f"{command[0]}.out", "wb") as out:  # the daemons' own chatter, kept for failures
            return subprocess.Popen(list(command), env=env, stdout=out, stderr=subprocess.STDOUT)

    daemons = [start("munged", "-F", "--force", f"--key-file={munge / 'munge.key'}",
                     f"--socket={munge / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
                     f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munge.seed'}")]
    try:
        _wait_for(lambda: (munge / "munge.socket").exists(), "munged", root)
        daemons.append(start("slurmctld", "-D", "-i"))
        daemons.append(start("slurmd", "-D", "-N", "localhost"))
        _wait_for(lambda: _node_idle(env), "slurmctld and slurmd (node idle)", root)
        yield env
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--full", "--user=root"], env=env, timeout=10, capture_output=True)
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
        _kill_step_daemons(root)


def _kill_step_daemons(root: Path) -> None:
    """The slurmstepd processes of this cluster's jobs, still running when it stopped (a job killed
    mid-step): they would outlive it, retrying a slurmd that is gone, and a later cluster's test
    would take them for its own job's steps (job ids start at 1 again)."""
    import signal

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "cmdline").read_bytes().startswith(b"slurmstepd"):
                continue
            if any(str(root) in os.readlink(fd) for fd in (proc / "fd").iterdir()):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to read
            continue


def _node_idle(env: dict[str, str]) -> bool:
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
    return done.returncode == 0 and done.stdout.strip() in ("idle", "mixed")


def _wait_for(ready, what: str, root: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in (root / "log").iterdir())
    raise RuntimeError(f"{what} did not start within {timeout} s\n{logs}")

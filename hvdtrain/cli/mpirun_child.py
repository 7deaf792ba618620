"""Horovod's MPI launch with mpirun as a child of hvdtrain's `horovodrun` entry (cli/launchers.py), in a
process group of its own, ended with the entry."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Callable

from hvdtrain.cli import forwarding
from hvdtrain.cli.mpirun_report import MpirunReport

PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal to this process when its parent dies


class MpirunAsChild:
    """`os` for Horovod's MPI launch, except that `execve` of mpirun runs it as a child and exits
    with its status: exec'd in place, a signal to horovodrun reached only the shell it became,
    which died and left mpirun and the ranks running.

    mpirun runs in a process group of its own, so a terminal's Ctrl-C or hang-up (the terminal closed)
    reaches this entry alone, which passes it to the ranks here (`forward_to_ranks`; with none here, to
    mpirun) and exits with their 75. Given the SIGINT too, mpirun sent the ranks SIGTERM a second later
    and SIGKILL a second after that (Open MPI's odls_base_sigkill_timeout), killing them in the
    checkpoint of the stop. mpirun gets SIGHUP when this entry dies (kill -9 of the job, `timeout -k`),
    which ends its ranks. Its stderr passes
    through this entry, which says Open MPI's report of the job's end in one line (`MpirunReport`)."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    @staticmethod
    def execve(path: str, args: list[str], env: dict[str, str]) -> None:
        if len(args) == 3 and args[1] == "-c":  # Horovod's `sh -c "mpirun ..."`: mpirun in the shell's place,
            args = [args[0], "-c", f"exec {with_site_transports(args[2], env)}"]  # this entry's child, whom a
            # signal here can reach
        forwarding.launch_begins()  # the job itself, after Horovod's probes
        mpirun = subprocess.Popen(args, executable=path, env=env, preexec_fn=_alone_and_ends_with(os.getpid()),
                                  stderr=subprocess.PIPE)
        report = MpirunReport(mpirun.stderr, sys.stderr)
        code = mpirun.wait()  # stop signals meanwhile: forward_to_ranks
        report.finish()
        sys.exit(code if code >= 0 else 128 - code)


def _alone_and_ends_with(parent: int) -> Callable[[], None]:
    """For mpirun's process, before it runs: a process group of its own, and SIGHUP when `parent` dies."""
    import ctypes

    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux's; looked up here, not in the child before exec

    def child() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
            if os.getppid() != parent:  # died before the line above
                os.kill(os.getpid(), signal.SIGHUP)

    return child


# Horovod's transports for Open MPI: every one but InfiniBand's verbs (which break fork()).
HOROVOD_BTL = re.compile(r"-mca btl \^openib(?=\s)")
# A list of transports to leave out, as Open MPI writes it: no spaces, nothing for a shell to read.
EXCLUSIONS = re.compile(r"\^[\w-]+(,[\w-]+)*")
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def with_site_transports(command: str, env: dict[str, str]) -> str:
    """Horovod's mpirun command, its `-mca btl ^openib` widened by the transports Open MPI's own settings
    (its parameter files, OMPI_MCA_btl) leave out. A command line wins over those, so a site's
    `btl = ^uct,openib,ofi` (Debian's) was lost, and every rank loaded libfabric: seconds more for each
    job to start and end (BENCHMARKS.md). Only for a job on this host alone: another host's own settings are
    its own, and a command line would override them there (they may need a transport this one leaves out)."""
    if not HOROVOD_BTL.search(command) or not _on_this_host_alone(command):
        return command
    site = _site_btl(env)
    if not EXCLUSIONS.fullmatch(site):
        return command
    value = ",".join(dict.fromkeys(["openib", *site[1:].split(",")]))
    return HOROVOD_BTL.sub(lambda found: f"-mca btl ^{value}", command, count=1)


def _on_this_host_alone(command: str) -> bool:
    """Whether the hosts of mpirun's `-H` (Horovod's `-H localhost:2` for `-np 2` alone) are all this one."""
    import socket

    hosts = re.search(r"\s-H\s+(\S+)", command)
    if hosts is None:
        return False
    names = {entry.rsplit(":", 1)[0] for entry in hosts.group(1).split(",")} - _LOCAL_HOSTS - {socket.gethostname()}
    return not names or names == {socket.getfqdn()}  # asked of the resolver only where the name says no more


def _site_btl(env: dict[str, str]) -> str:
    """Open MPI's value of its `btl` parameter before any command line ("" where none is set, or Open MPI's
    ompi_info is not there or does not answer), as the mpirun found on `env`'s PATH would read it."""
    found = shutil.which("ompi_info", path=env.get("PATH"))
    if found is None:
        return ""
    try:
        shown = subprocess.run([found, "--parsable", "--param", "btl", "all", "--level", "9"], env=env,
                               capture_output=True, text=True, errors="replace", timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    prefix = "mca:btl:base:param:btl:value:"
    return next((line[len(prefix):].strip() for line in shown.splitlines() if line.startswith(prefix)), "")

"""How the GPU check (launch/gpu_check.py) runs its steps: each command in a session of its own with a
time bound, the whole check within a budget, each step ending as pass, fail or skip in the report
(launch/gpu_report.py), Horovod's build in the background. Standard library only, psutil when there:
it runs under the machine's own Python, before anything is installed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import Report  # noqa: E402  (beside this file)

ROOT = Path(__file__).resolve().parents[1]
MARGIN_S = 10  # of the budget, kept for the last report


@dataclass
class Ran:
    """One command's end: `rc` None when it was stopped at its time bound."""
    command: str
    rc: int | None
    output: str
    seconds: float


# What a step returns: (status, one line of what was seen, the command it ran, if any).
Outcome = tuple[str, str, Ran | None]


class Check:
    """One check's state: its deadline, scratch folders (WORK/venv, runs, logs), what is known so far
    (a GPU, hvdtrain installed, Horovod built) and its report."""

    def __init__(self, out: Path, kit: Path, python: str, work: Path, budget: float):
        self.started = time.monotonic()
        self.deadline = self.started + budget
        self.kit, self.python, self.work = kit, python, work
        self.venv, self.runs, self.logs = work / "venv", work / "runs", work / "logs"
        shutil.rmtree(self.runs, ignore_errors=True)
        shutil.rmtree(self.logs, ignore_errors=True)
        self.runs.mkdir(parents=True)
        self.report = Report(out, self.logs)
        self.env = {**os.environ, "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("PYTHONPATH", None)
        self.gpu = False  # a GPU is visible to torch
        self.installed = False
        self.horovod: bool | None = None  # None until the build has ended
        self.build: subprocess.Popen | None = None
        self.build_started = 0.0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def do(self, name: str, action: Callable[[], Outcome], needs: tuple[str, ...] = ("install",)) -> None:
        """Runs one step unless what it needs is missing, and rewrites the report."""
        started = time.monotonic()
        why = self._missing(needs)
        if why:
            status, note, ran = "skip", why, None
        else:
            try:
                status, note, ran = action()
            except Exception as err:  # a fault of the check itself: reported, and the check goes on
                status, note = "fail", f"the check failed: {type(err).__name__}: {err}"
                ran = Ran("", None, traceback.format_exc(), 0.0)
        self.report.add(name, status, time.monotonic() - started, note, ran.command if ran else "",
                        ran.output if ran else "")
        self.report.save(time.monotonic() - self.started)
        print(f"[gpu-check] {name}: {status}: {note}", flush=True)

    def _missing(self, needs: tuple[str, ...]) -> str:
        if "install" in needs and not self.installed:
            return "skipped: hvdtrain is not installed (see install)"
        if "gpu" in needs and not self.gpu:
            return "skipped: no GPU is visible to torch here"
        if "horovod" in needs and not self.horovod:
            return "skipped: Horovod did not build (see horovod-build)"
        if self.left() < 30:
            return f"skipped: the check's time ran out ({self.deadline - self.started:.0f} s)"
        return ""

    def run(self, name: str, command: list[str], bound: float, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> Ran:
        """Runs a command to its end, or stops it and all it started after `bound` seconds (less when
        the check's budget is short); its output goes to the step's log too."""
        timeout = max(1.0, min(bound, self.left() - MARGIN_S))
        log = self.logs / f"{name}.log"
        shown = shlex.join(command)
        with log.open("a") as sink:
            sink.write(f"$ {shown}\n")
            sink.flush()
            offset = sink.tell()
            started = time.monotonic()
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**self.env, **(env or {})}, cwd=cwd or self.work, start_new_session=True)
            try:
                rc: int | None = process.wait(timeout)
            except subprocess.TimeoutExpired:
                stop(process)
                rc = None
        with log.open() as source:
            source.seek(offset)
            output = source.read()
        if rc is None:
            output += f"\n[gpu-check] stopped after {timeout:.0f} s\n"
        return Ran(shown, rc, output, time.monotonic() - started)

    def start_build(self) -> None:
        """Horovod builds in the background (niced) while the steps that do not need it run."""
        log = (self.logs / "horovod-build.out").open("w")
        self.build = subprocess.Popen(
            ["nice", "-n", "10", "bash", str(ROOT / "launch" / "gpu-horovod-build.sh"), str(self.venv),
             "--kit", str(self.kit), "--log", str(self.logs / "horovod-build.log")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, cwd=self.work,
            start_new_session=True)
        self.build_started = time.monotonic()

    def finish_build(self, bound: float) -> Ran:
        command = "bash launch/gpu-horovod-build.sh VENV --kit KIT"
        if self.build is None:
            return Ran(command, 1, "the build never started", 0.0)
        try:
            rc: int | None = self.build.wait(max(1.0, min(bound - (time.monotonic() - self.build_started),
                                                          self.left() - MARGIN_S)))
        except subprocess.TimeoutExpired:
            stop(self.build)
            rc = None
        output = (self.logs / "horovod-build.out").read_text()
        log = self.logs / "horovod-build.log"
        if rc is None and log.exists():  # stopped: where the build was
            output += "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        return Ran(command, rc, output, time.monotonic() - self.build_started)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the command and everything it started (launchers start their workers in sessions of
    their own), SIGKILL to all of them 10 s later."""
    try:
        import psutil

        family = psutil.Process(process.pid).children(recursive=True)
    except Exception:  # psutil missing, or the process already gone
        family = []
    for number, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, number)
        except OSError:  # its group is gone
            pass
        for child in family:
            try:
                child.send_signal(number)  # psutil checks that it is still the same process
            except Exception:  # gone already
                pass
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass

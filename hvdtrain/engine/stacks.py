"""One rank's report of where it is: every thread's Python stack (the main thread first) and what the
training loop is doing, as plain data that crosses a socket as JSON, and its text for the run directory.

Taken from another thread of the same process (`sys._current_frames`), so the training thread is never
interrupted: a rank stuck in a sleep, a lock or a collective reports as well as a busy one.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from hvdtrain.engine.activity import Activity, in_phase
from hvdtrain.errors import library_file

Frame = list[Any]
"""[file, line, function, source line]."""


def rank_report(rank: int, device: str, activity: Activity) -> dict[str, Any]:
    """This rank's report now: its activity and every other thread's stack."""
    now = activity.snapshot()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main, me = threading.main_thread().ident, threading.get_ident()
    stacks = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):
        if ident == me:  # the thread writing this report
            continue
        frames = [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_stack(frame)]
        stacks.append({"thread": names.get(ident, f"thread {ident}"), "frames": frames})
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "device": device,
            "where": now.where, "phase": now.phase, "phase_for": time.time() - now.phase_since,
            "collective": now.collective, "collective_for": time.time() - now.since if now.collective else 0.0,
            "stacks": stacks}


def state(report: dict[str, Any]) -> str:
    """What the rank does, in hvdtrain's terms."""
    if report["collective"]:
        return f"waiting {report['collective_for']:.0f} s in {report['collective']} at {report['where']}"
    return f"{in_phase(report['phase'], report['where'])}, for {report['phase_for']:.0f} s"


def main_frames(report: dict[str, Any]) -> list[Frame]:
    """The main thread's frames, outermost first."""
    stacks = report["stacks"]
    return stacks[0]["frames"] if stacks and stacks[0]["thread"] == "MainThread" else []


def user_frames(frames: list[Frame]) -> list[Frame]:
    """The frames of the user's own code (not hvdtrain's, the standard library's or a package's)."""
    return [frame for frame in frames if not library_file(frame[0])]


def frame_line(frame: Frame) -> str:
    file, line, function, source = frame
    return f"{file}:{line} in {function}" + (f": {source}" if source else "")


def report_text(report: dict[str, Any]) -> str:
    """The whole report, as the run directory keeps it: every thread, innermost call last."""
    lines = [f"rank {report['rank']}, host {report['host']}, pid {report['pid']}, device {report['device']}",
             state(report), ""]
    for stack in report["stacks"]:
        lines.append(f"Thread {stack['thread']} (most recent call last):")
        for file, line, function, source in stack["frames"]:
            lines.append(f'  File "{file}", line {line}, in {function}')
            if source:
                lines.append(f"    {source}")
        lines.append("")
    return "\n".join(lines)

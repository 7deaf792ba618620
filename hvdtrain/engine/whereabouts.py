"""Where every rank is: rank 0 gathers each rank's report (`stacks`) over the report channel at a stall
and when asked from another terminal (`hvdtrain where RUN_DIR`), prints a summary (which ranks wait
where; the stack of each rank that is elsewhere, the user's frames first) and keeps every rank's whole
report in the run directory, under `where/`.

Ranks on other hosts are reached through the connection each of them opened to rank 0 at start-up
(to the address rank 0's host uses towards the launcher's rendezvous, else its names), so `hvdtrain
where` runs on rank 0's host only and needs nothing open on the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hvdtrain.engine.activity import Activity, allowed_wait, in_phase, stall_line
from hvdtrain.engine.report_channel import (ANSWER_SECONDS, RankLink, ReportServer, end_process, own_addresses,
                                            request)
from hvdtrain.engine.stacks import frame_line, main_frames, rank_report, report_text, state, user_frames
from hvdtrain.io.run_dir import WHERE_FILE as LIVE_FILE, WHERE_FOLDER as FOLDER

_USER_FRAMES, _OTHER_FRAMES = 4, 2  # per rank in a summary; the files have every frame
_POLITE_WAIT = os.path.join("hvdtrain", "engine", "horovod_wait.py")
_WATCH_SLACK_SECONDS = 2.0
"""The most by which two ranks' watchdogs see the same stall apart (their polling interval)."""


class Whereabouts:
    """This rank's part: rank 0 serves (`server`), every other rank answers over its `link`."""

    def __init__(self, rank: int, size: int, device: str, activity: Activity):
        self.rank, self.size, self.device, self.activity = rank, size, device, activity
        self.server: ReportServer | None = None
        self.link: RankLink | None = None
        self.contact: tuple[str, int, str] | None = None  # (host, port, token) of rank 0's server
        self.run_dir: Path | None = None
        self._stalling = threading.Lock()
        self._kept = 0

    def own(self) -> dict[str, Any]:
        return rank_report(self.rank, self.device, self.activity)

    @classmethod
    def open(cls, engine: Any) -> "Whereabouts":
        """dist: every rank; rank 0 starts its server and tells the others where it is (a broadcast), each
        other rank connects to it, and rank 0 says in one line which ranks could not."""
        here = cls(engine.rank, engine.size, str(engine.device), engine.activity)
        offer, trouble = None, ""
        if engine.is_root:
            try:
                here.server = ReportServer(here._handle)
                offer = (socket.gethostname(), own_addresses(), here.server.port, here.server.token)
            except OSError as err:  # the job trains on without reports; the others must not wait for an offer
                trouble = f"cannot open its report port ({err.strerror or err})"
        offer = engine.broadcast_object(offer, "whereabouts")
        if offer is None:
            if engine.is_root:
                sys.stderr.write(f"hvdtrain: warning: rank 0 {trouble}: a stall report and `hvdtrain where` will "
                                 "name ranks without their stacks\n")
            return here
        host, addresses, port, token = offer
        if engine.is_root:
            here.contact = ("127.0.0.1", port, token)
        else:
            if host == socket.gethostname():
                addresses = ["127.0.0.1", *addresses]
            here.link, trouble = RankLink.connect(engine.rank, addresses, port, token, here.own)
            if here.link is not None:
                here.contact = (here.link.host, port, token)
        unreachable = [(rank, why) for rank, why in enumerate(engine.allgather_object(trouble, "whereabouts"))
                       if why and rank > 0]
        if unreachable and engine.is_root:  # dist: one line, from rank 0
            sys.stderr.write("hvdtrain: warning: " + "; ".join(f"rank {rank} cannot reach rank 0's report port "
                                                                 f"{port} ({why})" for rank, why in unreachable)
                             + ": a stall report and `hvdtrain where` will not show their stacks\n")
        return here

    def report_into(self, run_dir: Path) -> None:
        """Rank 0: reports go into `run_dir`, and `hvdtrain where` finds the job there."""
        if self.server is None:
            return
        self.run_dir = run_dir
        live, partial = run_dir / LIVE_FILE, run_dir / f".{LIVE_FILE}.{os.getpid()}"
        with contextlib.suppress(OSError):
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the token: its owner's alone
            with os.fdopen(fd, "w") as out:
                json.dump({"host": socket.gethostname(), "port": self.server.port, "token": self.server.token,
                           "pid": os.getpid(), "ranks": self.size}, out)
            os.replace(partial, live)  # whole or not at all, for a `hvdtrain where` reading it meanwhile

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self._unlist()
        if self.link is not None:
            self.link.close()

    def _unlist(self) -> None:
        """No job answers in the run directory any more. Only this job's file goes: the run directory
        is let go before the engine shuts down, and a job that took it since wrote its own."""
        if self.run_dir is not None:
            live = self.run_dir / LIVE_FILE
            with contextlib.suppress(OSError, ValueError):
                if json.loads(live.read_text()).get("token") == self.server.token:
                    live.unlink()

    # --- asked

    def _handle(self, asked: dict[str, Any]) -> dict[str, Any] | None:
        if asked.get("ask") == "where":
            return {"text": self.where_now()}
        if asked.get("ask") == "stalled":
            self.stalled(int(asked["rank"]), Activity.from_json(json.dumps(asked["activity"])),
                         float(asked["timeout"]))
        return None

    def where_now(self) -> str:
        """Rank 0: every rank's report now, kept in the run directory; the summary's text."""
        reports = self.server.ask_all(self.size, self.own)  # type: ignore[union-attr]
        folder = self._keep(reports, "")  # absolute: `hvdtrain where` is run from another directory than the job
        lines = [f"{self.size} ranks" + (f"; every rank's whole stack in {folder.absolute()}" if folder else "")]
        for rank, report in enumerate(reports):
            lines += _rank_lines(rank, report, stack=True)
        return "\n".join(lines)

    def report_stall(self, rank: int, activity: Activity, timeout: float) -> bool:
        """`rank`'s watchdog: its collective waited past `timeout`. Rank 0 reports every rank and ends the
        job (it does not return there); elsewhere, True once rank 0 took the report, False when it could not
        be asked or did not acknowledge within seconds (the caller reports what it knows itself). Once
        acknowledged, it returns when rank 0 has left, or after 3 x ANSWER_SECONDS."""
        if self.server is not None:
            self.stalled(rank, activity, timeout)
        if self.contact is None:
            return False
        host, port, token = self.contact
        asked = {"token": token, "ask": "stalled", "rank": rank, "activity": json.loads(activity.to_json()),
                 "timeout": timeout}
        try:
            # Acknowledged, then held until rank 0 has reported and left (closing this connection): this rank
            # must not end first, or its launcher would stop rank 0 in the middle of its report.
            request(host, port, asked, 3 * ANSWER_SECONDS)
        except ConnectionError:  # after the acknowledgement: rank 0 reported and left
            return True
        except (OSError, ValueError):  # not acknowledged (request says so as OSError), or not rank 0 at all
            return False
        return True

    def stalled(self, rank: int, activity: Activity, timeout: float) -> None:
        """Rank 0: prints the stall's report, keeps every rank's stack, and ends this process (the
        launcher then stops the others). A second stall report meanwhile waits for that end."""
        if not self._stalling.acquire(blocking=False):
            time.sleep(3 * ANSWER_SECONDS)
            return
        reports = self.server.ask_all(self.size, self.own)  # type: ignore[union-attr]
        rank, activity = _first_waiter(rank, activity, timeout, reports)
        folder = self._keep(reports, "stall")
        sys.stderr.write("\n".join(stall_lines(rank, activity, timeout, reports, folder)) + "\n")
        sys.stderr.flush()
        self.server.tell_all_to_leave()  # type: ignore[union-attr]
        self._unlist()
        end_process(1)  # the training thread is blocked in a collective or the user's code; nothing else ends it

    def _keep(self, reports: list[dict[str, Any] | None], name: str) -> Path | None:
        """Every rank's whole report, one file each, in the run directory (rank 0 writes shared files)."""
        if self.run_dir is None:
            return None
        self._kept += 1  # two asks within a second keep two folders
        folder = self.run_dir / FOLDER / "-".join(filter(None, (time.strftime("%Y%m%d-%H%M%S"), str(self._kept), name)))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for rank, report in enumerate(reports):
                text = report_text(report) if report else f"rank {rank} did not answer within {ANSWER_SECONDS:g} s\n"
                (folder / f"rank-{rank}.txt").write_text(text)
        except OSError as err:
            sys.stderr.write(f"hvdtrain: warning: could not keep the ranks' stacks in {folder}: {err.strerror or err}\n")
            return None
        return folder


def _first_waiter(rank: int, activity: Activity, timeout: float,
                  reports: list[dict[str, Any] | None]) -> tuple[int, Activity]:
    """The lowest rank that has waited about the timeout in a collective, and its activity: the ranks'
    watchdogs see one stall up to a polling interval apart, and the report names the same rank each time."""
    for other, report in enumerate(reports[:rank]):
        if report and report["collective"] and \
                report["collective_for"] >= allowed_wait(report["where"], timeout) - _WATCH_SLACK_SECONDS:
            since = time.time() - report["collective_for"]
            return other, Activity(where=report["where"], collective=report["collective"], since=since,
                                   phase=report["phase"])
    return rank, activity


def stall_lines(rank: int, mine: Activity, timeout: float, reports: list[dict[str, Any] | None],
                folder: Path | None) -> list[str]:
    """The stall's report: the error line (the rank that waited, and who was not there), each rank's state
    and the stacks of those elsewhere, and a last line naming the rank(s) the job stopped for."""
    here = (mine.collective, mine.where)
    away = [(r, report) for r, report in enumerate(reports)
            if r != rank and (report is None or (report["collective"], report["where"]) != here)]
    lines = [stall_line(rank, mine, timeout, [f"rank {r} ({_short(report)})" for r, report in away]),
             "hvdtrain: where each rank was" + (f" (every rank's whole stack: {folder})" if folder else "") + ":"]
    waiting = [r for r, report in enumerate(reports) if (r == rank or report) and r not in dict(away)]
    if waiting:
        lines.append(f"  {_ranks(waiting)}: waiting in {mine.collective} at {mine.where}")
    for r, report in away:
        lines += _rank_lines(r, report, stack=True)
    if away:
        stuck = "; ".join(f"rank {r} {_short(report)}{_user_at(report)}" if report else f"rank {r}, which did not answer"
                          for r, report in away)
        lines.append(f"hvdtrain: the job stopped waiting for {stuck}")
    return lines


def _rank_lines(rank: int, report: dict[str, Any] | None, stack: bool) -> list[str]:
    if report is None:
        return [f"  rank {rank}: no answer within {ANSWER_SECONDS:g} s (gone, or its interpreter held in native code)"]
    lines = [f"  rank {rank} (host {report['host']}, pid {report['pid']}): {state(report)}"]
    if stack:
        frames = [frame for frame in main_frames(report) if not frame[0].endswith(_POLITE_WAIT)]  # Horovod's wait is
        users = list(reversed(user_frames(frames)))[:_USER_FRAMES]  # shown as Horovod's, not the loop polling it
        others = [frame for frame in reversed(frames) if frame not in users][:_OTHER_FRAMES]
        lines += [f"      your code: {frame_line(frame)}" for frame in users]
        lines += [f"      {'inside' if users else 'at'}: {frame_line(frame)}" for frame in others]
    return lines


def _short(report: dict[str, Any] | None) -> str:
    if report is None:
        return "no answer"
    if report["collective"]:
        return f"in {report['collective']} at {report['where']} for {report['collective_for']:.0f} s"
    return in_phase(report["phase"], report["where"])


def _user_at(report: dict[str, Any] | None) -> str:
    users = user_frames(main_frames(report)) if report else []
    return f", at {users[-1][0]}:{users[-1][1]} in {users[-1][2]}" if users else ""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"

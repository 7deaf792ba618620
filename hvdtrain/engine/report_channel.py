"""A side channel from every rank to rank 0, apart from the engine's collectives: one TCP connection
each rank opens to rank 0 at start-up and keeps. Over it rank 0 asks every rank for its report at a
stall (when the collectives are what is stuck) and when `hvdtrain where` asks; a thread on each rank
answers, so the training thread is never interrupted.

Messages are JSON lines. Every connection opens with the job's token, which only the job's ranks (told
in the start-up broadcast) and rank 0's run directory (`where.json`, readable by its owner) hold; rank 0
acknowledges each one at once, so a caller knows within seconds whether rank 0 heard it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, NoReturn

from hvdtrain.io import run_lock

ANSWER_SECONDS = 5.0
"""How long rank 0 waits for the ranks' reports; one that has not answered by then is reported as silent."""
LEAVE_AFTER_SECONDS = 2.0
"""How long after rank 0's stall report the other ranks end themselves, if the launcher has not yet."""
ACK_SECONDS = 3.0
"""How long a caller waits for rank 0 to acknowledge it (its server thread answers at once unless rank 0's
interpreter is held, in native code or gone)."""
_CONNECT_SECONDS = 3.0
_POLL_SECONDS = 0.5  # how often a waiting thread looks whether it should stop
_ACK = {"ack": True}


def end_process(status: int = 1) -> NoReturn:
    """Ends this rank at once, from any thread, wherever its training thread is stuck: its data-loader
    workers first (they leave stop signals to their rank, and one stuck in the user's code would outlive
    it), then the process, without unwinding."""
    run_lock.note_ending({"ended": "failed", "error": "the job stalled (rank 0's log says where each rank waited)"})
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError):
            os.kill(child.pid, signal.SIGKILL)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


class Lines:
    """JSON lines over a socket, read with deadlines."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def send(self, message: dict[str, Any]) -> None:
        self.sock.settimeout(ANSWER_SECONDS)
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def receive(self, seconds: float) -> dict[str, Any] | None:
        """The next message, or None when none came within `seconds`; ConnectionError once closed."""
        deadline = time.monotonic() + seconds
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except socket.timeout:
                return None
            if not chunk:
                raise ConnectionError("closed by the other end")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class ReportServer:
    """Rank 0's end: keeps every other rank's connection and asks them for reports; a request from
    outside (`hvdtrain where`, another rank's stall) goes to `handle`, whose answer is sent back."""

    def __init__(self, handle: Callable[[dict[str, Any]], dict[str, Any] | None]):
        self.token, self.handle = os.urandom(16).hex(), handle
        self.listener = socket.create_server(("", 0), backlog=128)  # every interface: other hosts' ranks connect
        self.port: int = self.listener.getsockname()[1]
        self.links: dict[int, Lines] = {}
        self._asking = threading.Lock()
        self._asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hvdtrain-report-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(_POLL_SECONDS)
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:  # closed
                return
            # One thread a connection: a caller that says nothing holds up no one else.
            threading.Thread(target=self._greet, args=(Lines(sock),), name="hvdtrain-report-caller",
                             daemon=True).start()

    def _greet(self, lines: Lines) -> None:
        """A rank registering its link, or a request (`hvdtrain where`, a rank's stall): anything else,
        a wrong token or a malformed line, is closed without an answer."""
        try:
            hello = lines.receive(ANSWER_SECONDS)
            if not isinstance(hello, dict) or not hmac.compare_digest(str(hello.get("token", "")), self.token):
                lines.close()
                return
            rank = hello.get("rank")
            if "ask" not in hello and isinstance(rank, int) and not isinstance(rank, bool) and rank > 0:
                lines.send(_ACK)
                self.links[rank] = lines
                return
            lines.send(_ACK)
            answer = self.handle(hello)
            if answer is not None:
                lines.send(answer)
        except Exception:  # noqa: BLE001 - the asker is gone or sent nonsense: this thread only ends
            pass
        lines.close()

    def ask_all(self, size: int, own: Callable[[], dict[str, Any]]) -> list[dict[str, Any] | None]:
        """Every rank's report, in rank order (rank 0's from `own`); None for a rank that did not answer
        within ANSWER_SECONDS."""
        with self._asking:
            self._asked += 1
            asked = []
            for rank, lines in list(self.links.items()):
                try:
                    lines.send({"ask": "report", "id": self._asked})
                    asked.append(rank)
                except OSError:
                    self.links.pop(rank, None)
            reports: list[dict[str, Any] | None] = [None] * size
            reports[0] = own()
            deadline = time.monotonic() + ANSWER_SECONDS
            for rank in asked:
                reports[rank] = self._answer(rank, deadline) if rank < size else None
            return reports

    def _answer(self, rank: int, deadline: float) -> dict[str, Any] | None:
        lines = self.links[rank]
        try:
            while True:
                answer = lines.receive(max(0.0, deadline - time.monotonic()))
                if answer is None or answer.get("id") == self._asked:  # a late answer to an earlier ask: skipped
                    return answer["report"] if answer else None
        except (OSError, ValueError):
            self.links.pop(rank, None)
            return None

    def tell_all_to_leave(self) -> None:
        for lines in list(self.links.values()):
            with contextlib.suppress(OSError):
                lines.send({"ask": "leave"})

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _POLL_SECONDS)
        for lines in list(self.links.values()):
            lines.close()


class RankLink:
    """Another rank's end: answers rank 0's requests with `report()`, from a thread of its own."""

    def __init__(self, lines: Lines, report: Callable[[], dict[str, Any]], host: str):
        self.lines, self.report, self.host = lines, report, host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, name="hvdtrain-report-link", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, rank: int, hosts: list[str], port: int, token: str,
                report: Callable[[], dict[str, Any]]) -> "tuple[RankLink | None, str]":
        """Connected to the first of `hosts` that answers; (None, why) when none does."""
        failures = []
        for host in hosts:
            try:
                lines = Lines(socket.create_connection((host, port), timeout=_CONNECT_SECONDS))
            except OSError as err:
                failures.append(f"{host}: {err.strerror or err}")
                continue
            try:
                lines.send({"token": token, "rank": rank})
                if lines.receive(ACK_SECONDS) == _ACK:  # rank 0's server, not another one on that port
                    return cls(lines, report, host), ""
                failures.append(f"{host}: no acknowledgement")
            except (OSError, ValueError) as err:
                failures.append(f"{host}: {getattr(err, 'strerror', None) or err}")
            lines.close()
        return None, "; ".join(failures)

    def _answer(self) -> None:
        while not self._stop.is_set():
            try:
                request = self.lines.receive(_POLL_SECONDS)
                if request is not None and request.get("ask") == "leave":
                    # dist: rank 0 reported a stall and leaves first (its exit is the one the launcher names);
                    # this rank follows, wherever its training thread is stuck.
                    time.sleep(LEAVE_AFTER_SECONDS)
                    end_process(1)
                if request is not None:
                    self.lines.send({"id": request.get("id"), "report": self.report()})
            except (OSError, ValueError):  # rank 0 is gone
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _POLL_SECONDS)
        self.lines.close()


def request(host: str, port: int, message: dict[str, Any], seconds: float) -> dict[str, Any] | None:
    """One request to rank 0 (`hvdtrain where`, a rank's stall): its answer; None when it was acknowledged
    but no answer came within `seconds` (0: the acknowledgement is all that is wanted). OSError when rank 0
    cannot be reached or did not acknowledge within ACK_SECONDS; ConnectionError when it closed after
    acknowledging, without answering."""
    try:  # a refused or reset connection before the acknowledgement is no ConnectionError to the caller
        sock = socket.create_connection((host, port), timeout=_CONNECT_SECONDS)
    except ConnectionError as err:
        raise OSError(err.strerror or str(err)) from None  # the same words; OSError(errno, ...) would be a ConnectionError again
    with sock:
        lines = Lines(sock)
        try:
            lines.send(message)
            acknowledged = lines.receive(ACK_SECONDS)
        except (ConnectionError, ValueError) as err:  # closed, or something else than rank 0 answered
            raise OSError(f"closed without acknowledging ({err})") from None
        if acknowledged != _ACK:
            raise OSError("no acknowledgement: rank 0's interpreter is held, or this is not its port")
        return lines.receive(seconds) if seconds > 0 else None


def own_addresses() -> list[str]:
    """Where other hosts may reach this one, the likeliest first: the address this host uses towards
    the launcher's rendezvous (the network the job already runs on), then its names."""
    found = []
    for peer in (os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("MASTER_ADDR")):
        if peer:
            with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((peer, 9))  # UDP: nothing is sent, the route picks the address
                found.append(probe.getsockname()[0])
    found += [socket.getfqdn(), socket.gethostname()]
    with contextlib.suppress(OSError):
        found += socket.gethostbyname_ex(socket.gethostname())[2]
    return list(dict.fromkeys(address for address in found if address and address != "0.0.0.0"))

"""mpirun's stderr under hvdtrain's `horovodrun` entry, passed on as it comes, except Open MPI's boxed
report of how the job ended: said as the entry says it under Gloo, in one line naming the worker that
ended first and how (`horovodrun: worker 1 was killed by SIGKILL (exit status 137); the other workers
were stopped`), and nothing after a clean stop on a signal (every rank exited 75). Open MPI boxed it in
eleven lines, "the job has been aborted", after bad input that rank 0 had said in one, and after a
stop with a checkpoint. Its other help texts (too few slots, a host it cannot reach) pass unchanged.
"""

from __future__ import annotations

import codecs
import os
import re
import threading
from typing import BinaryIO, TextIO

from hvdtrain.cli.outcome import outcome

RULE = re.compile(rb"-{20,}\s*")  # the lines around each of Open MPI's help texts
JOB_ABORTED = b"Primary job  terminated normally, but"
EXITED = re.compile(rb"mpirun detected that one or more processes exited with non-zero status.*"
                    rb"Process name: \[\[\d+,\d+\],(\d+)\]\s+Exit code:\s+(\d+)", re.S)
SIGNALLED = re.compile(rb"mpirun noticed that process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
RANKS_OWN = re.compile(rb".*?\[\d+,\d+\]<std(out|err)>:")  # a rank's line, as --tag-output marks it (timestamped or not)


class MpirunReport:
    """Reads mpirun's stderr in a thread of its own and writes it to `out`; `finish` once mpirun has ended."""

    def __init__(self, source: BinaryIO, out: TextIO, launcher: str = "horovodrun") -> None:
        self.source, self.out, self.launcher = source, out, launcher
        self.box: list[bytes] | None = None  # a help text's lines, from its opening rule
        self.partial = b""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, name="mpirun-report", daemon=True)
        self.thread.start()

    def finish(self, timeout: float = 2.0) -> None:
        """After mpirun ended: what is left to read (a process on another host may hold the pipe open a
        while), then anything held back as it was."""
        self.thread.join(timeout)
        with self.lock:
            self._write(b"".join(self.box or []) + self.partial, final=True)
            self.box, self.partial = None, b""

    def _read(self) -> None:
        fd = self.source.fileno()
        broken = False
        while chunk := _read_some(fd):  # to the end, whatever happens: a pipe left full would hold mpirun
            with self.lock:
                if broken:
                    self._write(chunk)
                    continue
                try:
                    self._chunk(chunk)
                except Exception:  # a bug here: the rest as it comes, never a job held up
                    broken = True
                    self._write(b"".join(self.box or []) + self.partial)
                    self.box, self.partial = None, b""

    def _chunk(self, chunk: bytes) -> None:
        self.partial += chunk
        *lines, self.partial = re.split(rb"(?<=\n)", self.partial)
        for line in lines:
            self._line(line)
        if self.box is None and self.partial and not self.partial.startswith(b"-"):
            self._write(self.partial)  # a progress bar's line, rewritten in place: shown as it comes
            self.partial = b""

    def _line(self, line: bytes) -> None:
        if self.box is None or RANKS_OWN.match(line):  # a rank's own line inside a box comes out as it comes
            # A rank's line in progress without its end (a progress bar, cleared with `\r`) may come first.
            head, sep, tail = line.rpartition(b"\r")
            if self.box is None and RULE.fullmatch(tail):
                self._write(head + sep)
                self.box = [tail]
            else:
                self._write(line)
            return
        self.box.append(line)
        if RULE.fullmatch(line) and len(self.box) > 1:
            box, self.box = b"".join(self.box), None
            self._box(box)

    def _box(self, box: bytes) -> None:
        if JOB_ABORTED in box:
            return  # names nothing; the box after it says who
        exited, signalled = EXITED.search(box), SIGNALLED.search(box)
        if exited:
            rank, code, host = int(exited.group(1)), int(exited.group(2)), ""
        elif signalled:
            rank, code = int(signalled.group(1)), 128 + int(signalled.group(3))
            host = _other_host(signalled.group(2).decode(errors="replace"))
        else:
            self._write(box)
            return
        line = outcome({rank: (code, 0.0)})[1]
        if line and host:  # on several hosts, where it died (the out-of-memory killer's host, say)
            line = line.replace(f"worker {rank} ", f"worker {rank} (on {host}) ", 1)
        if line:
            self._write(f"{self.launcher}: {line}\n".encode())

    def _write(self, data: bytes, final: bool = False) -> None:
        try:
            text = self.decoder.decode(data, final=final)
            if text and self.out is not None:  # None: started with stderr closed
                self.out.write(text)
                self.out.flush()
        except Exception:  # nobody reads it any more (`| head`): the job goes on
            pass


def _other_host(name: str) -> str:
    """`name`, unless it is this host."""
    import socket

    here = {"localhost", socket.gethostname(), socket.gethostname().split(".")[0]}
    return "" if name in here or name.split(".")[0] in here else name


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""

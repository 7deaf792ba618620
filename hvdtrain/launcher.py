"""The `horovodrun` entry that launch/install.sh puts in the environment.

It runs Horovod's own launcher unchanged. The only difference: when a worker fails,
Horovod's Gloo launcher raises and prints its own traceback under the worker's
one-line error; here that report is one line too, and the exit status is the worker's.
"""

from __future__ import annotations

import re
import signal
import sys


def horovodrun() -> None:
    from horovod.runner.launch import run_commandline

    try:
        sys.exit(run_commandline())
    except RuntimeError as err:
        message = " ".join(str(err).split())
        if "exited with non-zero status" not in message:
            raise
        found = re.search(r"Process name: (\S+) Exit code: (-?\d+)", message)
        if found is None:
            print(f"horovodrun: {message}", file=sys.stderr, flush=True)
            sys.exit(1)
        worker, code = found.group(1), int(found.group(2))
        print(f"horovodrun: worker {worker} {_describe_exit(code)}; the other workers were stopped",
              file=sys.stderr, flush=True)
        sys.exit(code if code > 0 else 1)


def _describe_exit(code: int) -> str:
    """`exited with status 2`, or the signal a shell's 128+N status stands for."""
    number = code - 128 if code > 128 else -code if code < 0 else 0
    if number:
        try:
            return f"was killed by {signal.Signals(number).name} (exit status {code})"
        except ValueError:
            pass
    return f"exited with status {code}"


if __name__ == "__main__":
    horovodrun()

"""The `horovodrun` entry that launch/install.sh puts in the environment.

It runs Horovod's own launcher unchanged. The only difference: when a worker fails,
Horovod's Gloo launcher raises and prints its own traceback under the worker's
one-line error; here that report is one line too, and the exit status is the worker's.
"""

from __future__ import annotations

import re
import sys


def horovodrun() -> None:
    from horovod.runner.launch import run_commandline

    try:
        sys.exit(run_commandline())
    except RuntimeError as err:
        message = " ".join(str(err).split())
        if "exited with non-zero status" not in message:
            raise
        code = re.search(r"Exit code: (-?\d+)", message)
        print(f"horovodrun: {message}", file=sys.stderr, flush=True)
        sys.exit(int(code.group(1)) if code and int(code.group(1)) > 0 else 1)


if __name__ == "__main__":
    horovodrun()

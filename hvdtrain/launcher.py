"""The `horovodrun` and `torchrun` entries that launch/install.sh puts in the environment.

Each runs the launcher it is named after unchanged. The only difference: when a worker
fails, Horovod's Gloo launcher and torchrun each raise and print a traceback and a
report of their own under the worker's one-line error; here that report is one line
too, and the exit status is the worker's. torchrun also takes `hvdtrain` as the program
(`torchrun --nproc-per-node 2 hvdtrain fit`), which it would otherwise look for as a
Python file in the current directory.
"""

from __future__ import annotations

import os
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


def torchrun() -> None:
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(None)
    if args.training_script == "hvdtrain" and not (args.no_python or args.module or os.path.exists("hvdtrain")):
        args.module = True  # python -m hvdtrain: the same program as the `hvdtrain` command
    # torchrun logs each failed worker at ERROR before it raises; the line below says it once.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"torchrun: worker rank {rank} {_describe_exit(failure.exitcode)}; the other workers were stopped",
              file=sys.stderr, flush=True)
        sys.exit(failure.exitcode if failure.exitcode > 0 else 1)


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

"""What hvdtrain's `horovodrun` and `torchrun` entries refuse of their own arguments, before anything
starts: one line and status 2, where Horovod's runner and torchrun printed a traceback, or (`horovodrun
--gloo -np 0`) ran nothing and exited 0."""

from __future__ import annotations

import sys
from typing import Any

_verbose = False  # horovodrun --verbose: the runner's own refusals keep their traceback


def checked(parse_args: Any) -> Any:
    """Horovod's argument parser, and a number of processes that can run: `-np 0` under --gloo ran
    nothing and exited 0 (a script's unset $NP), under MPI it was Open MPI's "already filled"."""
    def parse() -> Any:
        global _verbose
        args = parse_args()
        _verbose = args.verbose
        for option, number in (("-np", args.num_proc), ("--min-np", args.min_num_proc), ("--max-np", args.max_num_proc)):
            if number is not None and number < 1:
                refuse("horovodrun", f"{option} must be at least 1, got {number}")
        return args

    return parse


def refuse(launcher: str, message: str, code: int = 2) -> None:
    """One line for what the launcher refused, and `code`; after horovodrun --verbose, the runner's traceback."""
    if _verbose and sys.exc_info()[0] is not None:
        raise
    print(f"{launcher}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def said(err: Exception) -> str:
    """An exception's message in one line, as a user reads it: a file not found with its path."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    message = " ".join(str(err).split())
    if message.startswith("Requested more processes"):
        message += ": ask fewer with -np, or give the hosts more slots (-H host:SLOTS, or slots=SLOTS in a hostfile)"
    return message


def check_torchrun_sizes(args: Any) -> None:
    """--nproc-per-node and --nnodes as torchrun can run them; it refused others with a traceback of its
    own (an AssertionError alone for `--nproc-per-node 0`)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        per_node = determine_local_world_size(args.nproc_per_node)
    except ValueError as err:
        per_node, why = 0, f" ({str(err).rstrip('.')})" if "Unsupported" not in str(err) else ""
    else:
        why = ""
    if per_node < 1:
        refuse("torchrun", f"--nproc-per-node {args.nproc_per_node}{why}: give a number of processes per node (at "
               "least 1), or auto, cpu or gpu")
    try:
        fewest, most = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        fewest = most = 0
    if not 0 < fewest <= most:
        refuse("torchrun", f"--nnodes {args.nnodes}: give a number of nodes (at least 1), or MIN:MAX of them")

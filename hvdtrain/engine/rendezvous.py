"""Where the torch engine's ranks meet: the rendezvous address from the launcher's variables or
HVDTRAIN_INIT_METHOD, and the checks that make a rendezvous that cannot succeed fail at once, in words."""

from __future__ import annotations

import os

from hvdtrain.engine.environment import port_for_job, slurm_first_node
from hvdtrain.errors import RendezvousFailed, UserError


def init_method(one_host: bool) -> str:
    """Where the ranks meet: HVDTRAIN_INIT_METHOD (tcp://HOST:PORT, as init_process_group's
    init_method), else env:// (MASTER_ADDR and MASTER_PORT; on one host they default to
    127.0.0.1 and a port derived from the launcher's job id)."""
    method = os.environ.get("HVDTRAIN_INIT_METHOD", "env://")
    if not method.startswith(("tcp://", "env://", "file://")):
        raise UserError(f"HVDTRAIN_INIT_METHOD must be tcp://HOST:PORT (rank 0's host and a free port), env:// "
                        f"or file://PATH, got '{method}'")
    if method == "env://" and "MASTER_ADDR" not in os.environ and not one_host:
        first_node = slurm_first_node()
        if first_node:
            os.environ["MASTER_ADDR"] = first_node  # dist: rank 0 runs on the step's first node
    if method == "env://" and "MASTER_ADDR" not in os.environ:
        if not one_host:
            raise UserError("--engine torch across hosts needs MASTER_ADDR and MASTER_PORT (rank 0's host and a "
                            "free port) in every process's environment, e.g. mpirun -x MASTER_ADDR -x MASTER_PORT "
                            "(launch/slurm.sbatch sets them), or HVDTRAIN_INIT_METHOD=tcp://HOST:PORT")
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # dist: every rank on this host
    if method == "env://":
        os.environ.setdefault("MASTER_PORT", str(port_for_job()))
    return method


def could_not_listen(err: BaseException) -> bool:
    """The rendezvous's host could not open its port (torch's words for EADDRINUSE and the like), as
    against a rendezvous that began and failed later (a timeout, a rank that left)."""
    text = str(err).lower()
    return any(words in text for words in ("failed to listen", "failed to bind", "address already in use"))


# Without a launcher (a PyTorchJob's pods), how long a rank waits for rank 0's host name to resolve:
# a pod's name resolves once that pod runs, which may be after this one starts.
RESOLVE_WAIT_SECONDS = 120.0


def require_resolvable(where: str, rank: int, wait_seconds: float = 0.0) -> None:
    """A host name that does not resolve fails at once (after `wait_seconds`, said in one line), not
    after the rendezvous timeout (torch retries it for minutes)."""
    import socket
    import sys
    import time
    from urllib.parse import urlsplit

    host = urlsplit(where).hostname
    if not host or where.startswith("file://"):
        return
    deadline, said = time.monotonic() + wait_seconds, False
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise RendezvousFailed(f"rank {rank}: the ranks cannot meet at {where}: host '{host}' does not "
                                       f"resolve ({err.strerror or err}). MASTER_ADDR (or the host in "
                                       "HVDTRAIN_INIT_METHOD) must name rank 0's host") from err
            if not said:
                print(f"hvdtrain: rank {rank}: waiting for rank 0's host '{host}' to resolve (a pod's name does "
                      f"once the pod runs), up to {wait_seconds:.0f} s", file=sys.stderr, flush=True)
                said = True
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

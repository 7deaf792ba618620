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


def require_resolvable(where: str, rank: int) -> None:
    """A host name that does not resolve fails at once, not after the rendezvous timeout (torch
    retries it for minutes)."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(where).hostname
    if not host or where.startswith("file://"):
        return
    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        raise RendezvousFailed(f"rank {rank}: the ranks cannot meet at {where}: host '{host}' does not resolve "
                               f"({err.strerror or err}). MASTER_ADDR (or the host in HVDTRAIN_INIT_METHOD) must "
                               "name rank 0's host") from err

"""One process of `hvdtrain.launch` (hvdtrain/local_launch.py): runs the pickled job; rank 0 keeps
its result, a failing rank its error, in the job's directory.

    python -m hvdtrain.launch_worker JOB_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


# How long a rank stopped by another's failure waits before it exits (the launcher ends it sooner).
SURVIVOR_WAIT_SECONDS = 3.0


def main(job_dir: Path) -> None:
    """One process of a launch: runs the job; rank 0 keeps its result, a failing rank its error."""
    import cloudpickle

    from hvdtrain.engine import launcher_rank
    from hvdtrain.errors import AnotherRankFailed

    rank = launcher_rank() or 0
    try:
        result = cloudpickle.loads((job_dir / "job.pkl").read_bytes())()
    except BaseException as err:
        # A rank stopped by another's failure keeps its word for when the failed rank left none, and says
        # nothing: a line of its own would read as a second failure.
        survivor = isinstance(err, AnotherRankFailed)
        report = {"rank": rank, "kind": type(err).__name__, "message": str(err).strip(), "at": time.time(),
                  "traceback": traceback.format_exc(), "survivor": survivor}
        _write(job_dir / f"error-{rank}.json", json.dumps(report).encode())
        if not survivor:
            print(f"hvdtrain: launch: rank {rank} failed: {report['kind']}: {report['message']}", file=sys.stderr,
                  flush=True)
        else:  # the failed rank's report and exit first: the launcher names the first to exit
            time.sleep(SURVIVOR_WAIT_SECONDS)
        os._exit(err.exit_code if survivor else 1)
    if rank == 0:
        _write(job_dir / "result.pkl", cloudpickle.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # past the interpreter's teardown of the engine, as the command leaves


def _write(path: Path, data: bytes) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

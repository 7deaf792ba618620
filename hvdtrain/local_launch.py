"""`hvdtrain.launch`: several processes on this host from a notebook or a script, no shell command.

    import hvdtrain
    summary = hvdtrain.launch({"model": Net(), "data": (train_set, val_set), "epochs": 5}, np=4)
    answer = hvdtrain.launch(my_function, np=4, engine="torch")   # my_function() on every rank

The function (or `hvdtrain.fit` with the settings) runs in `np` processes started by this package's
`horovodrun --gloo` (the Horovod engine) or `torchrun` (the torch engine), so a launch behaves as
those commands do: a rank that fails stops the others. It travels by cloudpickle, so a function
defined in a notebook works too. Rank 0's result comes back; a failure raises `LaunchFailed`
naming the rank that failed first, with its error.

Each process runs `python -m hvdtrain.launch_worker JOB_DIR`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

ENGINES = ("horovod", "torch")


class LaunchFailed(RuntimeError):
    """A process of `launch` failed: `rank`, the error's `kind` and `message`, its `traceback` text."""

    def __init__(self, message: str, rank: int | None = None, kind: str = "", error: str = "", trace: str = ""):
        super().__init__(message)
        self.rank, self.kind, self.error, self.traceback = rank, kind, error, trace


def launch(fn_or_settings: Callable[..., Any] | Mapping[str, Any], np: int = 2, engine: str = "horovod",
           args: tuple = (), kwargs: Mapping[str, Any] | None = None, timeout: float | None = None) -> Any:
    """Runs `fn(*args, **kwargs)`, or `hvdtrain.fit(**settings)` for a mapping, on `np` processes of
    this host under `engine` ('horovod': horovodrun --gloo; 'torch': torchrun) and returns rank 0's
    result. Their output is printed here as it comes."""
    import cloudpickle

    from hvdtrain.errors import UserError

    if engine not in ENGINES:
        raise UserError(f"engine must be one of {', '.join(ENGINES)}, got '{engine}'")
    if not isinstance(np, int) or np < 1:
        raise UserError(f"np must be a whole number of processes, at least 1, got {np!r}")
    if isinstance(fn_or_settings, Mapping):
        job: Any = _FitJob(dict(fn_or_settings))
    elif callable(fn_or_settings):
        job = _CallJob(fn_or_settings, tuple(args), dict(kwargs or {}))
    else:
        raise UserError(f"launch takes a function or fit's settings as a dict, got {type(fn_or_settings).__name__}")
    with tempfile.TemporaryDirectory(prefix="hvdtrain-launch-") as directory:
        job_dir = Path(directory)
        (job_dir / "job.pkl").write_bytes(cloudpickle.dumps(job))
        code = _run(_command(engine, np, job_dir), timeout)
        return _outcome(job_dir, code)


class _CallJob:
    def __init__(self, function: Callable[..., Any], args: tuple, kwargs: dict[str, Any]):
        self.function, self.args, self.kwargs = function, args, kwargs

    def __call__(self) -> Any:
        return self.function(*self.args, **self.kwargs)


class _FitJob:
    def __init__(self, settings: dict[str, Any]):
        self.settings = settings

    def __call__(self) -> Any:
        from hvdtrain.api import fit

        return fit(**self.settings)


def _command(engine: str, np: int, job_dir: Path) -> list[str]:
    bin_dir = Path(sys.executable).parent  # this environment's launchers (hvdtrain's entries)
    worker = ["-m", "hvdtrain.launch_worker", str(job_dir)]
    if engine == "torch":
        return [str(bin_dir / "torchrun"), "--nproc-per-node", str(np), *worker]
    return [str(bin_dir / "horovodrun"), "--gloo", "-np", str(np), sys.executable, *worker]


def _run(command: list[str], timeout: float | None) -> int:
    env = dict(os.environ)
    # The caller's modules (a function pickled by reference) import in the workers as they did here.
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    relay = threading.Thread(target=_relay, args=(process.stdout,), daemon=True)
    relay.start()
    try:
        code = process.wait(timeout=timeout)
    except BaseException:  # a timeout, or Ctrl-C in the notebook: the processes end with the call
        import signal

        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        relay.join(timeout=5)
    return code


def _relay(stream: Any) -> None:
    for line in stream:  # print, not a copy to fd 1: a notebook shows what print writes
        print(line, end="", flush=True)


def _outcome(job_dir: Path, code: int) -> Any:
    # The rank that failed first; a rank stopped by it only where the failed one left no word (killed).
    errors = sorted((json.loads(path.read_text()) for path in job_dir.glob("error-*.json")),
                    key=lambda e: (e.get("survivor", False), e["at"]))
    if errors and not errors[0].get("survivor"):
        first = errors[0]
        raise LaunchFailed(f"rank {first['rank']} failed: {first['kind']}: {first['message']}", first["rank"],
                           first["kind"], first["message"], first["traceback"])
    if errors:
        raise LaunchFailed(f"the processes ended with status {code}: {errors[0]['message']} (their output is above)")
    result = job_dir / "result.pkl"
    if code != 0 or not result.exists():
        raise LaunchFailed(f"the processes ended with status {code} before rank 0 returned (their output is above)")
    import cloudpickle

    return cloudpickle.loads(result.read_bytes())

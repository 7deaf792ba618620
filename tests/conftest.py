"""Shared helpers: running hvdtrain under real launchers on the CPU, and reading what its runs wrote."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

import container_image
import file_order

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Each launcher as a user types it, for 2 processes on this host.
LAUNCHERS = {
    "horovodrun-gloo": ["horovodrun", "--gloo", "-np", "2"],
    "horovodrun-mpi": ["horovodrun", "--mpi", "-np", "2"],
    "mpirun": ["mpirun", "-np", "2", "--oversubscribe"],
    "torchrun": ["torchrun", "--nproc-per-node", "2"],  # the torch engine (--engine auto picks it)
}
HOROVOD_AND_TORCH = ["horovodrun-gloo", "torchrun"]  # one launcher per engine


def python_under(launcher: str) -> list[str]:
    """The launcher's command line up to a Python script's path (torchrun starts Python itself)."""
    return LAUNCHERS[launcher] if launcher == "torchrun" else [*LAUNCHERS[launcher], sys.executable]


def DOWNLOADED(root: Path) -> list[str]:
    """A user's data fetched into `root` where no intact copy is, then checked (user_code.downloaded_digits):
    root/calls.log is there once the factory was called."""
    return ["--data", "user_code:downloaded_digits", "--set", f"data.args.root={root}"]


def launch_env(pythonpath: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # torch's env:// rendezvous, where the tests run in a PyTorchJob's pod: fit would join it
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = pythonpath or f"{ROOT}{os.pathsep}{ROOT / 'tests'}"
    # OpenMPI refuses root without these; containers and CI run as root.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.pop("HOROVOD_RANK", None)
    return env


def run(command: list[str], *, timeout: float = 180, cwd: Path | None = None, pythonpath: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs a command to completion, `env` added to the launch environment; a hang fails the test
    instead of blocking it."""
    return subprocess.run(command, env={**launch_env(pythonpath), **(env or {})}, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def fit_under(launcher: str | None, *args: str, timeout: float = 180, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`hvdtrain fit --progress off *args` under the launcher (None: one process, no launcher); `env`
    reaches every rank (mpirun is told each name with -x, as it must be on several hosts)."""
    prefix = LAUNCHERS[launcher] if launcher else []
    if env and launcher == "mpirun":
        prefix = [*prefix, *(arg for name in env for arg in ("-x", name))]
    return run([*prefix, "hvdtrain", "fit", "--progress", "off", *args], timeout=timeout, cwd=cwd, env=env)


def assert_ok(done: subprocess.CompletedProcess, tail: int = 3000) -> subprocess.CompletedProcess:
    """`done`, once it is known to have exited 0; else the test fails with the ends of its output."""
    assert done.returncode == 0, f"exit {done.returncode}\n{(done.stdout or '')[-tail:]}\n{(done.stderr or '')[-tail:]}"
    return done


def fit_ok(launcher: str | None, *args: str, **options) -> subprocess.CompletedProcess:
    """`fit_under` that must succeed."""
    return assert_ok(fit_under(launcher, *args, **options))


def epoch_records(run_dir: Path) -> list[dict]:
    """The epoch records of a run's metrics.jsonl, read by the project's own reader; a line that is not a
    whole record fails the test (a resume would drop it)."""
    from hvdtrain.io.run_dir import read_metrics

    path = run_dir / "metrics.jsonl"
    assert path.is_file(), f"{path} is missing"
    return read_metrics(path, warn=pytest.fail)


def step_losses(run_dir: Path) -> dict[int, float]:
    """TensorBoard's `steps/train_loss` of a run (run.log_every), by step; each step there once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    points = events.Scalars("steps/train_loss")
    assert len({p.step for p in points}) == len(points)
    return {p.step: p.value for p in points}


def fit_here(run_dir: Path, *args: str) -> dict:
    """`hvdtrain fit` on the local engine in this process, no launcher: the run's summary. The process
    goes on, so fit gives its signal handlers back (a SIG_IGN left would reach every later subprocess)."""
    import signal

    from hvdtrain.cli import main

    before, threads = signal.getsignal(signal.SIGUSR1), torch.get_num_threads()
    try:
        main(["fit", "--progress", "off", "--engine", "local", "--run-dir", str(run_dir), *args])
    finally:
        torch.set_num_threads(threads)  # fit sets this process's (--threads): the tests after it keep theirs
    assert signal.getsignal(signal.SIGUSR1) == before
    return run_summary(run_dir)


def run_summary(run_dir: Path) -> dict:
    """The run's summary.json, which fit writes once it ends."""
    return json.loads((run_dir / "summary.json").read_text())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick; another process may take it later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def shared_run(tmp_path_factory, name: str, command: list[str]) -> tuple[Path, subprocess.CompletedProcess]:
    """(run directory, finished command) of a run that must succeed, made once for the whole session: under
    pytest-xdist the first worker to need it runs it, in the session's shared temporary directory, and the
    others read what it left (each worker has session fixtures of its own)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common parent
    folder = root / f"shared-{name}"
    with FileLock(f"{folder}.lock"):
        record = folder / "finished.json"
        if not record.exists():  # not made yet, or a worker's attempt failed (its test says why): afresh
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            done = assert_ok(run([*command, "--run-dir", str(folder / "run")], cwd=folder))
            record.write_text(json.dumps({"stdout": done.stdout, "stderr": done.stderr}))
        finished = json.loads(record.read_text())
    return folder / "run", subprocess.CompletedProcess(command, 0, finished["stdout"], finished["stderr"])


@pytest.fixture(scope="session")
def digits_torchrun(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The same digits run as `digits_np2`, under `torchrun --nproc-per-node 2` (the torch engine)."""
    return shared_run(tmp_path_factory, "digits-torchrun", [*LAUNCHERS["torchrun"], "hvdtrain", "fit", "--progress",
                                                            "off", "--epochs", "3", "--log-every", "4"])


@pytest.fixture(scope="session")
def digits_np2(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One digits run of 3 epochs under plain `horovodrun -np 2` (MPI controller), with step logging
    and Horovod's timeline, shared by the tests of fit's launch and of what comes after fit."""
    return shared_run(tmp_path_factory, "digits-np2", ["horovodrun", "-np", "2", "hvdtrain", "fit", "--progress", "off",
                                                       "--epochs", "3", "--log-every", "4", "--horovod-timeline"])


def have(command: str) -> bool:
    return shutil.which(command, path=launch_env()["PATH"]) is not None


requires_launchers = pytest.mark.skipif(
    not (have("horovodrun") and have("mpirun") and have("torchrun")),
    reason="horovodrun, mpirun and torchrun are installed by launch/install.sh (make test)",
)


SSHD = Path("/usr/sbin/sshd")
requires_sshd = pytest.mark.skipif(not SSHD.exists(), reason="needs openssh-server (launch/install.sh installs it as root)")


@contextlib.contextmanager
def sshd(hosts: tuple[str, ...], keys: Path) -> Iterator[tuple[int, Path]]:
    """An sshd of the test's own on loopback addresses, so horovodrun sees several hosts.

    Makes a host key and a client key, listens on a free high port of each address,
    and yields (port, client key).
    """
    keys.mkdir()
    for name in ("client", "host"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    port = free_port(hosts[0])
    config = keys / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", *(f"ListenAddress {host}" for host in hosts), f"HostKey {keys / 'host'}",
        f"AuthorizedKeysFile {keys / 'authorized_keys'}", "PasswordAuthentication no", "UsePAM no",
        "StrictModes no", f"PidFile {keys / 'sshd.pid'}", "",
    ]))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    daemon = subprocess.Popen([str(SSHD), "-D", "-f", str(config), "-E", str(keys / "sshd.log")])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((hosts[-1], port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port, keys / "client"
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= atol, f"{name} differs by {diff}"


# pytest-xdist (make test runs 2 workers, --dist loadfile): each test file runs whole on one
# worker, so that its module fixtures (shared runs, the Slurm cluster) are made once.


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    """Under pytest-xdist the controller starts the container image's build, once for every worker,
    in its own temporary directory; the worker that runs tests/test_docker.py waits for it there."""
    config = session.config
    workers = getattr(config.option, "numprocesses", None)
    if _is_xdist_worker(config) or not workers or config.option.collectonly:
        return
    chosen = config.args or ["tests"]
    if not any(Path(arg.split("::")[0]).is_dir() or "test_docker" in arg for arg in chosen):
        return  # only some other files
    if container_image.available() is None and "not system" not in (config.option.markexpr or ""):
        build = container_image.Build(ROOT, config._tmp_path_factory.getbasetemp() / "containers")
        config.stash[container_image.BUILD] = build
        config.add_cleanup(build.stop)


def shared_build(config) -> "container_image.Build | None":
    """The image build this session started: this process's own, or, on an xdist worker, the controller's."""
    build = config.stash.get(container_image.BUILD, None)
    if build is None and _is_xdist_worker(config):
        build = container_image.Build.attach(config._tmp_path_factory.getbasetemp().parent / "containers")
    return build


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """GPU tests run where a GPU is visible and are skipped elsewhere (CI has none). Under xdist the
    files come longest first (tests/file_order.py), the container image's after the long ones: the
    controller started its build. Otherwise the build starts now, in the background, and its tests
    run last: the build waits on downloads and disks far more than on the CPU, so it costs little
    beside the other tests."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if _is_xdist_worker(config):
        file_order.longest_first(items)
        return
    images = [item for item in items if item.path.name == file_order.IMAGE_TESTS]
    if images and container_image.available() is None and not config.option.collectonly:
        items[:] = [item for item in items if item not in images] + images
        build = container_image.Build(ROOT, config._tmp_path_factory.mktemp("containers"))
        config.stash[container_image.BUILD] = build
        config.add_cleanup(build.stop)

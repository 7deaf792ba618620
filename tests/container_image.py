"""Builds docker/Dockerfile.cpu for real with buildah and runs it with podman, on this machine.

No registry is needed: the base image is Debian 12 from debootstrap (with its Python 3.11),
imported into a container store of the test's own (overlay storage in a temporary
directory, runc as the runtime, container rlimits left as they are: crun and raised
rlimits fail inside this machine). When the host's pip takes packages from local
mirrors, the build gets the same pip settings as a build secret and the mirrors as
read-only volumes, as a user behind a mirror would pass them. The Horovod wheel that
launch/install.sh built on this machine (same Debian, Python, torch and OpenMPI) is handed
to the build as a wheelhouse, so the image's install.sh installs it instead of compiling
Horovod a second time.

The build takes minutes and uses little CPU once Horovod is not compiled: `start_build`
runs it in the background while the rest of the suite runs (conftest starts it).

    python tests/container_image.py REPO ROOT   # what start_build runs: base image, then the build
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

TOOLS = ("buildah", "podman", "runc", "debootstrap")
BASE = "localhost/hvdtrain-base:bookworm"
MIRROR = os.environ.get("HVDTRAIN_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def available() -> str | None:
    """Why images cannot be built here; None when they can."""
    path = f"/usr/sbin:/usr/bin:{os.environ.get('PATH', '')}"
    missing = [tool for tool in TOOLS if shutil.which(tool, path=path) is None]
    if missing:
        return f"needs {', '.join(missing)} (launch/install-cluster-tools.sh installs them as root)"
    if os.geteuid() != 0:
        return "building images with buildah here needs root"
    return None


def store_env(root: Path) -> dict[str, str]:
    """Environment for buildah and podman with a container store under `root`."""
    (root / "graph").mkdir(parents=True, exist_ok=True)
    (root / "run").mkdir(exist_ok=True)
    (root / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{root / "graph"}"\nrunroot = "{root / "run"}"\n')
    (root / "containers.conf").write_text(
        '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n[engine]\nruntime = "runc"\n')
    return {**os.environ, "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
            "CONTAINERS_CONF": str(root / "containers.conf"), "PATH": f"/usr/sbin:{os.environ.get('PATH', '')}"}


def make_base(root: Path, env: dict[str, str]) -> None:
    """Debian 12 (minbase, Python 3.11, CA certificates) as the local image BASE."""
    rootfs = root / "rootfs"
    _check(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm",
            str(rootfs), MIRROR], env, timeout=900)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    _check(["podman", "import", "-", BASE], env, stdin=tar.stdout, timeout=300)
    tar.wait()
    shutil.rmtree(rootfs)


def pip_settings(root: Path) -> list[str]:
    """buildah arguments that hand the host's pip settings (local mirrors, CA bundle) to the build."""
    shown = subprocess.run(["pip", "config", "list"], capture_output=True, text=True).stdout
    values: dict[str, str] = {}
    for line in shown.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in ("find-links", "extra-index-url", "index-url", "cert") and name not in values:
            values[name] = value.strip().strip("'\"")
    if not values:
        return []
    args: list[str] = []
    mounts: list[str] = []
    lines = ["[global]"]
    for name, value in values.items():
        if name == "cert":
            args += ["--secret", f"id=ca.crt,src={value}"]
            lines.append("cert = /run/secrets/ca.crt")
            continue
        kept = []
        for location in value.split():
            local = Path(location.removeprefix("file://"))
            if location.startswith(("http://", "https://")):
                kept.append(location)
            elif local.exists():  # a mirror on this machine's disk: mounted read-only at the same path
                top = Path("/", *local.parts[1:3])
                mounts.append(f"{top}:{top}:ro")
                kept.append(location)
        if kept:
            lines.append(f"{name} = {' '.join(kept)}")
    (root / "pip.conf").write_text("\n".join(lines) + "\n")
    for mount in dict.fromkeys(mounts):
        args += ["--volume", mount]
    return [*args, "--secret", f"id=pip.conf,src={root / 'pip.conf'}"]


def wheelhouse() -> list[str]:
    """buildah arguments that lend the build this machine's Horovod wheels (launch/install.sh's cache)."""
    cache = Path(os.environ.get("HVDTRAIN_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                                / "hvdtrain")) / "wheels"
    if not any(cache.glob("*/horovod-*.whl")):
        return []
    return ["--volume", f"{cache}:/wheelhouse:ro", "--build-arg", "HVDTRAIN_WHEELHOUSE=/wheelhouse"]


def build(repo: Path, root: Path, env: dict[str, str], tag: str, log: Path) -> subprocess.CompletedProcess:
    command = ["buildah", "bud", "--isolation", "chroot", "--format", "docker", "-f", "docker/Dockerfile.cpu",
               "--build-arg", f"BASE_IMAGE={BASE}", *pip_settings(root), *wheelhouse(), "-t", tag, "."]
    with open(log, "w") as out:
        return subprocess.run(command, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=2400)


def _check(command: list[str], env: dict[str, str], timeout: float, stdin=None) -> None:
    done = subprocess.run(command, env=env, stdin=stdin, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed: {done.stderr[-2000:]}")


TAG = "localhost/hvdtrain:cpu-test"
BUILD = pytest.StashKey["Build"]()  # the session's build, started by conftest


class Build:
    """The base image and the image of docker/Dockerfile.cpu, built by a background process. The
    process writes its exit status to `root/status` last, and its owner its pid to `root/pid`, so
    that another process of the session (a pytest-xdist worker) can wait for the same build:
    `Build.attach(root)`. The owner removes the images when it stops."""

    def __init__(self, repo: Path | None, root: Path):
        self.root = root
        self.log = root / "build.log"
        self.process: subprocess.Popen | None = None
        if repo is None:
            return
        root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.process = subprocess.Popen([sys.executable, __file__, str(repo), str(root)], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        (root / "pid").write_text(str(self.process.pid))

    @classmethod
    def attach(cls, root: Path) -> "Build | None":
        """The build another process of this session started in `root`; None if none did."""
        return cls(None, root) if (root / "pid").exists() else None

    def wait(self, timeout: float = 2400) -> dict[str, str]:
        """Waits for the build; the store's environment once it succeeded."""
        deadline = time.monotonic() + timeout
        status = self.root / "status"
        while not status.exists() and self._running():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the image build took over {timeout} s: {self.log.read_text()[-3000:]}")
            time.sleep(1)
        code = int(status.read_text()) if status.exists() else 1  # killed before it could say
        if code != 0:
            raise RuntimeError(f"the image build failed: {self.log.read_text()[-5000:]}")
        return store_env(self.root / "store")

    def _running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        import psutil

        try:  # the owner reaps it only when it stops: a zombie has ended
            return psutil.Process(int((self.root / "pid").read_text())).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:  # its buildah and tar too: the build runs in a session of its own
            os.killpg(self.process.pid, 9)
            self.process.wait()
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(["podman", "rmi", "-f", TAG, BASE], env=store_env(self.root / "store"),
                           capture_output=True, timeout=120)


def _build_all(repo: Path, root: Path) -> None:
    env = store_env(root / "store")
    started = time.monotonic()
    make_base(root, env)
    print(f"base image {time.monotonic() - started:.0f} s", flush=True)
    based = time.monotonic()
    done = build(repo, root / "store", env, TAG, root / "buildah.log")
    if done.returncode != 0:
        print((root / "buildah.log").read_text()[-5000:])
        sys.exit(1)
    print(f"build {time.monotonic() - based:.0f} s", flush=True)


if __name__ == "__main__":
    code = 1
    try:
        _build_all(Path(sys.argv[1]), Path(sys.argv[2]))
        code = 0
    finally:  # whole or absent for a process that waits on it
        (Path(sys.argv[2]) / "status.tmp").write_text(str(code))
        os.replace(Path(sys.argv[2]) / "status.tmp", Path(sys.argv[2]) / "status")
    sys.exit(code)

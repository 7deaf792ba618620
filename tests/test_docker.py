"""docker/Dockerfile.cpu built with buildah and run with podman, for real: `hvdtrain doctor`,
`horovodrun -np 2 hvdtrain fit` and `mpirun -np 2 hvdtrain fit` inside a container, the run
directory on a volume of the host."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import container_image
from conftest import ROOT, assert_ok, run_summary, shared_build

why_not = container_image.available()
pytestmark = [pytest.mark.system, pytest.mark.multiprocess, pytest.mark.timeout(3000),
              pytest.mark.skipif(why_not is not None, reason=why_not or "")]

TAG = container_image.TAG


@pytest.fixture(scope="module")
def image(request, tmp_path_factory):
    """The image, from the build that conftest started in the background when the session began."""
    build = shared_build(request.config)
    own = build is None  # this module alone, e.g. with -p no:... or an explicit node id
    if own:
        build = container_image.Build(ROOT, tmp_path_factory.mktemp("containers"))
    started = time.monotonic()
    env = build.wait()
    print(f"\nwaited {time.monotonic() - started:.0f} s for the image; {build.log.read_text().strip()}")  # -s shows it
    yield env, build.root
    if own:
        build.stop()


def _podman_run(env: dict, runs: Path, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", "run", "--rm", "-v", f"{runs}:/runs", TAG, *command], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_image_s_doctor_finds_nothing_wrong(image):
    env, root = image
    done = _podman_run(env, root, "hvdtrain", "doctor")
    assert_ok(done)
    assert "horovod 0.28.1: controllers mpi, gloo" in done.stdout and "ok: ready to launch" in done.stdout


@pytest.mark.parametrize("launcher", [["horovodrun", "-np", "2"], ["mpirun", "-np", "2"]], ids=["horovodrun", "mpirun"])
def test_fit_on_two_processes_in_the_container_writes_to_the_host(image, launcher, tmp_path):
    env, _ = image
    tmp_path.chmod(0o777)
    done = _podman_run(env, tmp_path, *launcher, "hvdtrain", "fit", "--epochs", "2", "--progress", "off",
                       "--run-dir", "/runs/run")
    assert_ok(done)
    summary = run_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["controller"] == "mpi" and summary["val_acc"] > 0.85
    assert (tmp_path / "run" / "checkpoints" / "best.pt").is_file()


def test_horovodrun_across_two_containers_over_ssh(image, tmp_path):
    """The README's several-nodes recipe: sshd in each container, horovodrun -H from one of them."""
    env, _ = image
    keys, runs = tmp_path / "keys", tmp_path / "runs"
    keys.mkdir()
    runs.mkdir(mode=0o777)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id_ed25519")], check=True)
    (keys / "authorized_keys").write_bytes((keys / "id_ed25519.pub").read_bytes())
    # Networks live outside the test's container store: a run stopped midway leaves its own behind.
    network = f"hvdtrain-test-{os.getpid()}-{tmp_path.name}"[:60]
    subprocess.run(["podman", "network", "rm", "-f", network], env=env, capture_output=True)
    subprocess.run(["podman", "network", "create", network], env=env, check=True, capture_output=True)
    workers = ["w1", "w2"]
    start_sshd = ("mkdir -p /root/.ssh && cp /keys/authorized_keys /keys/id_ed25519 /root/.ssh/ && "
                  "chmod 600 /root/.ssh/* && ssh-keygen -A >/dev/null && exec /usr/sbin/sshd -D -p 2222")
    try:
        for name in workers:
            subprocess.run(["podman", "run", "-d", "--name", f"{network}-{name}", "--hostname", name, "--network",
                            network, "-v", f"{keys}:/keys:ro", "-v", f"{runs}:/runs", TAG,
                            "bash", "-c", start_sshd], env=env, check=True, capture_output=True, timeout=60)
        # Each host learns the others' names from its hosts file, as on a cluster without DNS: podman's
        # own name resolution needs a network plugin (CNI's dnsname or aardvark-dns) that hosts may lack.
        addresses = {name: _address(env, f"{network}-{name}") for name in workers}
        hosts_lines = "".join(f"{address} {name}\n" for name, address in addresses.items())
        for name in workers:
            subprocess.run(["podman", "exec", f"{network}-{name}", "sh", "-c", f"printf '{hosts_lines}' >> /etc/hosts"],
                           env=env, check=True, capture_output=True, timeout=60)
        time.sleep(2)
        done = subprocess.run(["podman", "exec", f"{network}-w1", "horovodrun", "-np", "2", "-H", "w1:1,w2:1", "-p",
                               "2222", "hvdtrain", "fit", "--epochs", "2", "--progress", "off", "--run-dir",
                               "/runs/run"], env=env, capture_output=True, text=True, timeout=600)
        assert_ok(done)
        # One process per container: each is local rank 0 of 1 on its own host.
        assert "rank 0/2 local_rank 0/1" in done.stdout + done.stderr
        assert "rank 1/2 local_rank 0/1" in done.stdout + done.stderr
        assert run_summary(runs / "run")["world_size"] == 2
    finally:
        subprocess.run(["podman", "rm", "-f", *(f"{network}-{w}" for w in workers)], env=env, capture_output=True)
        subprocess.run(["podman", "network", "rm", network], env=env, capture_output=True)


def _address(env: dict, container: str) -> str:
    """The container's address on its (only) podman network."""
    shown = subprocess.run(["podman", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                            container], env=env, check=True, capture_output=True, text=True, timeout=60)
    address = shown.stdout.strip()
    assert address, f"{container} has no address on its network"
    return address

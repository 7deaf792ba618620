"""A real two-host run on one machine: sshd on two loopback addresses, horovodrun over SSH.

The test makes its own host key and client key and starts its own sshd on a free high
port, listening on 127.0.0.2 and 127.0.0.3; horovodrun treats those as two hosts and
starts one rank on each through SSH.
"""

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import requires_launchers, run

SSHD = Path("/usr/sbin/sshd")
HOSTS = ("127.0.0.2", "127.0.0.3")

pytestmark = [pytest.mark.multiprocess, requires_launchers,
              pytest.mark.skipif(not SSHD.exists(), reason="needs openssh-server (launch/install.sh installs it as root)")]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOSTS[0], 0))
        return probe.getsockname()[1]


@pytest.fixture
def two_ssh_hosts(tmp_path):
    keys = tmp_path / "ssh"
    keys.mkdir()
    for name in ("client", "host"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    port = _free_port()
    config = keys / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", *(f"ListenAddress {host}" for host in HOSTS), f"HostKey {keys / 'host'}",
        f"AuthorizedKeysFile {keys / 'authorized_keys'}", "PasswordAuthentication no", "UsePAM no",
        "StrictModes no", f"PidFile {keys / 'sshd.pid'}", "",
    ]))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    daemon = subprocess.Popen([str(SSHD), "-D", "-f", str(config), "-E", str(keys / "sshd.log")])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((HOSTS[1], port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port, keys / "client"
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


def test_horovodrun_across_two_ssh_hosts(two_ssh_hosts, tmp_path):
    port, key = two_ssh_hosts
    done = run(["horovodrun", "--gloo", "-np", "2", "-H", ",".join(f"{h}:1" for h in HOSTS), "-p", str(port),
                "-i", str(key), "--start-timeout", "60", "hvdtrain", "fit", "--epochs", "2", "--progress", "off",
                "--run-dir", str(tmp_path / "run")], timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # One rank per host: each is local rank 0 of 1 on its host, in a world of 2.
    assert "rank 0/2 local_rank 0/1" in done.stderr and "rank 1/2 local_rank 0/1" in done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_acc"] > 0.85

"""A real two-host run on one machine: sshd on two loopback addresses, horovodrun over SSH.

The test makes its own host key and client key and starts its own sshd on a free high
port, listening on 127.0.0.2 and 127.0.0.3; horovodrun treats those as two hosts and
starts one rank on each through SSH.
"""

import pytest

from conftest import assert_ok, requires_launchers, requires_sshd, run, run_summary, sshd

HOSTS = ("127.0.0.2", "127.0.0.3")

pytestmark = [pytest.mark.multiprocess, requires_launchers, requires_sshd]


@pytest.fixture
def two_ssh_hosts(tmp_path):
    with sshd(HOSTS, tmp_path / "ssh") as (port, key):
        yield port, key


def test_horovodrun_across_two_ssh_hosts(two_ssh_hosts, tmp_path):
    port, key = two_ssh_hosts
    done = run(["horovodrun", "--gloo", "-np", "2", "-H", ",".join(f"{h}:1" for h in HOSTS), "-p", str(port),
                "-i", str(key), "--start-timeout", "60", "hvdtrain", "fit", "--epochs", "2", "--progress", "off",
                "--run-dir", str(tmp_path / "run")], timeout=180)
    assert_ok(done)
    # One rank per host: each is local rank 0 of 1 on its host, in a world of 2.
    assert "rank 0/2 local_rank 0/1" in done.stderr and "rank 1/2 local_rank 0/1" in done.stderr
    summary = run_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["val_acc"] > 0.85

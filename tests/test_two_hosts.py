"""Two hosts joined by a throttled link (benchmarks/two_hosts.py: two network namespaces, a veth pair
limited to 1 Gbit/s by a token bucket), one rank on each: `fit` trains across it under torchrun and,
over SSH, under horovodrun, with compressed gradients: each host sent over the link at least what
`hvdtrain plan` says the gradients take, and less than fp32's would.

Needs root, iproute2's `ip` and `tc` and openssh-server (launch/install-cluster-tools.sh); skipped
where namespaces cannot be made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, assert_ok, launch_env, requires_launchers, requires_sshd
from hvdtrain.cli import main

sys.path.insert(0, str(ROOT))
from benchmarks.two_hosts import (ADDRESSES, SSH_KEYS, horovodrun_on_two_hosts, ssh_daemons,  # noqa: E402
                                  throttled_hosts, torchrun_on_two_hosts, unavailable)

pytestmark = [pytest.mark.system, requires_launchers, requires_sshd, pytest.mark.timeout(600)]
FIT = ["--epochs", "2", "--progress", "off", "--threads", "1", "--set", "model.hidden=2048"]  # 150 k parameters


@pytest.fixture(scope="module")
def hosts():
    """The two hosts and their sshd, for the module's tests (skipped where namespaces cannot be made)."""
    why = unavailable()
    if why:
        pytest.skip(why)
    with throttled_hosts("1gbit") as prefixes, ssh_daemons(prefixes, SSH_KEYS) as key:
        yield prefixes, key


def link_bytes(prefix: list[str]) -> int:
    """Bytes the host has sent over its end of the link so far (its token bucket's count)."""
    shown = subprocess.run([*prefix, "tc", "-s", "qdisc", "show", "dev", "hv0"], capture_output=True, text=True,
                           check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", shown).group(1))


def trained(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def planned_bytes(compression: str, tmp_path) -> int:
    """What `hvdtrain plan` says each rank sends for the gradients of the run's every step."""
    main(["plan", "--np", "2", *FIT, "--compression", compression, "--json", str(tmp_path / "plan.json")])
    plan = json.loads((tmp_path / "plan.json").read_text())
    return plan["sent_per_step"][compression] * plan["steps_per_epoch"] * plan["epochs"]


def test_torchrun_across_two_hosts_with_powersgd(hosts, tmp_path):
    prefixes, _ = hosts
    before = [link_bytes(prefix) for prefix in prefixes]
    ranks = torchrun_on_two_hosts(prefixes, [*FIT, "--compression", "powersgd", "--run-dir", str(tmp_path / "run")],
                                  launch_env(), timeout=400)
    for rank in ranks:
        assert_ok(rank)
    for rank, started in enumerate(ranks):  # one rank per host, meeting at the first host's address
        assert f"rank {rank}/2 local_rank 0/1" in started.stderr and f"rendezvous env://{ADDRESSES[0]}:" in started.stderr
    assert trained(tmp_path / "run")["world_size"] == 2 and trained(tmp_path / "run")["val_acc"] > 0.85
    sent = [link_bytes(prefix) - was for prefix, was in zip(prefixes, before)]
    assert planned_bytes("powersgd", tmp_path) < min(sent) < planned_bytes("none", tmp_path), sent


def test_horovodrun_across_two_hosts_over_ssh_with_bf16(hosts, tmp_path):
    prefixes, key = hosts
    before = [link_bytes(prefix) for prefix in prefixes]
    done = assert_ok(horovodrun_on_two_hosts(prefixes, key, [*FIT, "--compression", "bf16", "--run-dir",
                                                             str(tmp_path / "run")], launch_env(), timeout=400))
    assert "rank 0/2 local_rank 0/1" in done.stderr and "rank 1/2 local_rank 0/1" in done.stderr
    assert trained(tmp_path / "run")["world_size"] == 2 and trained(tmp_path / "run")["val_acc"] > 0.85
    sent = [link_bytes(prefix) - was for prefix, was in zip(prefixes, before)]
    assert planned_bytes("bf16", tmp_path) < min(sent) < planned_bytes("none", tmp_path), sent

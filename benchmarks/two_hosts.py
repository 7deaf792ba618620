"""Two hosts joined by a slow link, on one machine: compressed gradients against the link's limit.

    sudo python benchmarks/two_hosts.py [--rate 1gbit] [--epochs 3]     (part of `make bench`, as root)

Each host is a network namespace of its own (its own interfaces, addresses and TCP stack), joined to
the other by a veth pair whose two ends are both named `hv0` (so that horovodrun and Gloo find one
interface name on every host) and each limited to RATE by a token bucket (`tc qdisc tbf`). Every
byte between the ranks crosses that link; nothing else does. One rank per host, started in its
namespace by `torchrun --nnodes 2` (the torch engine) or, over SSH, by `horovodrun --gloo`. The
machine's name resolves to a loopback address in both (as Debian's /etc/hosts has it on many
clusters): horovodrun's choice of interface must hold throughout (launch/horovod-source.sh).

The comm-heavy job: an MLP of 17 M parameters (68 MB of fp32 gradients a step) on digits, batch 32
a rank, one thread a rank. Samples/s (the epochs after the first) of fp32, fp16, bf16 and PowerSGD, each
against the no-communication ceiling (one rank alone, in one namespace, twice its rate), and each
one's validation accuracy after the same epochs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import BIN, environment, host_settings  # noqa: E402

ADDRESSES = ("10.77.0.1", "10.77.0.2")
SSH_KEYS = Path(os.environ.get("HVDTRAIN_CACHE", Path.home() / ".cache" / "hvdtrain")) / "two-hosts-ssh"
"""The two hosts' sshd keys, kept between runs."""
INTERFACE = "hv0"
WIDTH = 2896  # an input layer, 2 layers of 2896 x 2896 and a head: 17.0 M parameters
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
POWERSGD_RANKS = (2, 4)  # 4, the default: the lowest within 1 point of fp32's accuracy on this job


def comm_heavy(input_shape, num_classes):
    """The job's model: 3 linear layers of WIDTH, then a head."""
    import math

    from torch import nn

    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(math.prod(input_shape), WIDTH), nn.ReLU()]
    for _ in range(2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, num_classes))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why two throttled hosts cannot be made here; None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool, path=f"/usr/sbin:/sbin:{os.environ['PATH']}") is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2)"
    try:
        with throttled_hosts("1gbit"):
            return None
    except (OSError, subprocess.CalledProcessError) as err:
        return f"could not make two namespaces with a throttled link: {getattr(err, 'stderr', '') or err}".strip()


@contextlib.contextmanager
def throttled_hosts(rate: str) -> Iterator[list[list[str]]]:
    """Two namespaces joined at RATE; yields each one's command prefix (`ip netns exec NAME`). Removed
    on the way out, with their link (and any process left in them loses its network)."""
    names = [f"hvdtrain-{os.getpid()}-{side}" for side in "ab"]
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"hv{os.getpid()}a", "type", "veth", "peer", "name", f"hv{os.getpid()}b")
        for name, end, address in zip(names, (f"hv{os.getpid()}a", f"hv{os.getpid()}b"), ADDRESSES):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "link", "set", end, "name", INTERFACE)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _ip("-n", name, "link", "set", INTERFACE, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            # a token bucket: RATE on average, bursts of 1 MB, packets queued at most 50 ms
            subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", INTERFACE, "root", "tbf",
                            "rate", rate, "burst", "1mb", "latency", "50ms"], check=True, capture_output=True, text=True)
        yield [["ip", "netns", "exec", name] for name in names]
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)  # and the link's ends in it
        subprocess.run(["ip", "link", "delete", f"hv{os.getpid()}a"], capture_output=True)  # still here if set-up failed


def torchrun_on_two_hosts(hosts: list[list[str]], fit_args: list[str], env: dict[str, str],
                          timeout: float) -> list[subprocess.CompletedProcess]:
    """`hvdtrain fit` with one rank on each host, each host's own torchrun meeting at the first's address."""
    port = "29611"
    starts = [subprocess.Popen([*prefix, str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node),
                                "--nproc-per-node", "1", "--master-addr", ADDRESSES[0], "--master-port", port,
                                str(BIN / "hvdtrain"), "fit", *fit_args],
                               env={**env, "GLOO_SOCKET_IFNAME": INTERFACE}, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
              for node, prefix in enumerate(hosts)]
    done = []
    deadline = time.monotonic() + timeout
    for started in starts:
        try:
            out, err = started.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in starts:
                other.kill()
            out, err = started.communicate()
        done.append(subprocess.CompletedProcess(started.args, started.returncode, out, err))
    return done


@contextlib.contextmanager
def ssh_daemons(hosts: list[list[str]], keys: Path, port: int = 2222) -> Iterator[Path]:
    """An sshd of our own in each namespace, on its address: horovodrun reaches the hosts over SSH as it
    would real ones. Yields the client key. The keys in `keys` are made once and kept, so that the
    hosts' key stays the one ssh recorded the first time."""
    keys.mkdir(parents=True, exist_ok=True)
    for name in ("client", "host"):
        if not (keys / name).is_file():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    daemons = []
    try:
        for prefix, address in zip(hosts, ADDRESSES):
            config = keys / f"sshd_config.{address}"
            config.write_text("\n".join([
                f"Port {port}", f"ListenAddress {address}", f"HostKey {keys / 'host'}",
                f"AuthorizedKeysFile {keys / 'authorized_keys'}", "PasswordAuthentication no", "UsePAM no",
                "StrictModes no", f"PidFile {keys / f'sshd.{address}.pid'}", ""]))
            daemons.append(subprocess.Popen([*prefix, "/usr/sbin/sshd", "-D", "-f", str(config),
                                             "-E", str(keys / f"sshd.{address}.log")]))
        time.sleep(1)  # listening by then (sshd -D binds at once)
        yield keys / "client"
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()


def horovodrun_on_two_hosts(hosts: list[list[str]], key: Path, fit_args: list[str], env: dict[str, str],
                            timeout: float, port: int = 2222) -> subprocess.CompletedProcess:
    """`hvdtrain fit` under `horovodrun --gloo`, started on the first host, one rank on each over SSH."""
    return subprocess.run([*hosts[0], str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H",
                           ",".join(f"{address}:1" for address in ADDRESSES), "-p", str(port), "-i", str(key),
                           "--network-interface", INTERFACE, "--start-timeout", "60", str(BIN / "hvdtrain"), "fit",
                           *fit_args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def job_args(run_dir: Path, epochs: int, compression: str, batch: int = 32, powersgd_rank: int = 4) -> list[str]:
    return ["--powersgd-rank", str(powersgd_rank), "--model", "benchmarks.two_hosts:comm_heavy", "--data", "digits", "--batch-size", str(batch),
            "--epochs", str(epochs), "--threads", "1",
            "--optimizer", "sgd", "--lr", "0.01", "--no-scale-lr", "--progress", "off", "--no-tensorboard",
            "--compression", compression, "--run-dir", str(run_dir), "--overwrite"]


def rate_and_accuracy(run_dir: Path) -> tuple[float, float]:
    """Samples/s over the epochs after the first, and the last validation accuracy."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:] or records
    rate = sum(r["train_samples"] for r in timed) / sum(r["train_samples"] / r["train_samples_per_s"] for r in timed)
    return rate, records[-1]["val_acc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="the link's rate, as tc writes it (1gbit, 10gbit)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "two_hosts.json"))
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(f"bench: two hosts skipped: {why}")
        return
    env = environment({**host_settings(), "PYTHONPATH": str(ROOT)})
    results: dict[str, dict[str, float]] = {}
    ceiling = 0.0
    with tempfile.TemporaryDirectory() as scratch, throttled_hosts(args.rate) as hosts:
        alone = Path(scratch) / "alone"
        done = subprocess.run([*hosts[0], str(BIN / "hvdtrain"), "fit", *job_args(alone, args.epochs, "none", args.batch)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"bench: one rank alone failed:\n{done.stderr[-3000:]}")
        rate, accuracy = rate_and_accuracy(alone)
        ceiling = 2 * rate
        print(f"  ceiling (one rank alone, twice its rate): {ceiling:,.1f} samples/s", flush=True)
        runs = [(c, c, 4) for c in COMPRESSIONS if c != "powersgd"] + \
            [(f"powersgd rank {r}", "powersgd", r) for r in POWERSGD_RANKS]
        for name, compression, rank in runs:
            run_dir = Path(scratch) / name.replace(" ", "-")
            ranks = torchrun_on_two_hosts(hosts, job_args(run_dir, args.epochs, compression, args.batch, rank), env,
                                          timeout=3600)
            if any(rank.returncode != 0 for rank in ranks):
                sys.exit(f"bench: {name} on two hosts failed:\n" + "\n".join(r.stderr[-2000:] for r in ranks))
            rate, accuracy = rate_and_accuracy(run_dir)
            results[name] = {"samples_per_s": round(rate, 1), "of_ceiling": round(rate / ceiling, 3),
                                    "val_acc": accuracy}
            print(f"  {name}: {rate:,.1f} samples/s, {rate / ceiling:.2f} of the ceiling, val_acc "
                  f"{accuracy:.4f}", flush=True)
    Path(args.out).write_text(json.dumps({"rate": args.rate, "epochs": args.epochs, "batch": args.batch,
                                          "ceiling_samples_per_s":
                                          round(ceiling, 1), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()

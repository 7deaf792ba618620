"""Elastic training for real: horovodrun's elastic driver, workers on SSH loopback hosts.

Horovod drops the whole *host* of a failed worker, so the workers run on separate
loopback addresses (127.0.0.2 to .5) of this machine, one slot each, reached through
an sshd of the test's own. The host list comes from launch/discover-hosts.sh reading a
hostfile that the test edits while the job runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (ROOT, epoch_records, fit_under, launch_env, requires_launchers, requires_sshd, run, run_summary,
                      sshd)

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
FIRST_HOSTS, LOST_HOST, NEW_HOST = HOSTS[:3], HOSTS[2], HOSTS[3]
EPOCHS = 20

pytestmark = [pytest.mark.multiprocess, requires_launchers, requires_sshd]


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory):
    with sshd(HOSTS, tmp_path_factory.mktemp("elastic") / "ssh") as (port, key):
        yield port, key


def start_elastic(ssh_hosts, hostfile: Path, run_dir: Path, *args: str, **env_vars: str) -> subprocess.Popen:
    """`args` after the defaults (a later flag wins)."""
    port, key = ssh_hosts
    command = [
        "horovodrun", "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3",
        "--host-discovery-script", str(ROOT / "launch" / "discover-hosts.sh"), "-p", str(port), "-i", str(key),
        "--start-timeout", "60",
        # About 50 ms per step, so that the test can act mid-epoch; a commit every 2 steps.
        "hvdtrain", "fit", "--elastic", "--model", "user_code:paced_mlp", "--epochs", str(EPOCHS),
        "--threads", "1", "--progress", "off", "--set", "train.commit_every=2", "--run-dir", str(run_dir), *args,
    ]
    env = {**launch_env(), "HOSTFILE": str(hostfile), **env_vars}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def write_hosts(path: Path, hosts: tuple[str, ...]) -> None:
    path.write_text("".join(f"{host} slots=1\n" for host in hosts))


def records(run_dir: Path) -> list[dict]:
    """The run's epoch records so far (none before its first epoch ends)."""
    return epoch_records(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def worker_on(host: str) -> int:
    """The pid of the hvdtrain worker that horovodrun started on `host`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"python" in cmdline[0] and f"HOROVOD_HOSTNAME={host}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker found on {host}")


@contextlib.contextmanager
def ended_whatever_happens(job: subprocess.Popen):
    """A job still running when the block is left (a failed assertion, a timeout) is ended: it runs in a
    session of its own, which nothing of pytest's reaches, and would load the tests after it. The
    launcher is asked first (it ends its workers), then killed."""
    try:
        yield
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
            job.communicate()


def finish(job: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        pytest.fail(f"elastic job hung:\n{out[-3000:]}\n{err[-3000:]}")
    return job.returncode, out, err


def test_a_lost_worker_is_survived_and_a_new_one_joins(ssh_hosts, tmp_path):
    hostfile = tmp_path / "hosts"

    # The undisturbed run to compare with, beside the disturbed one: three processes throughout, not
    # elastic and not paced (its epochs' val_acc are an elastic run's of three workers, to the last digit).
    calm_dir, calm_log = tmp_path / "calm", tmp_path / "calm.log"
    with calm_log.open("w") as log:
        calm_job = subprocess.Popen(
            ["horovodrun", "--gloo", "-np", "3", "hvdtrain", "fit", "--model", "mlp", "--epochs", str(EPOCHS),
             "--threads", "1", "--progress", "off", "--run-dir", str(calm_dir)],
            env=launch_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    write_hosts(hostfile, FIRST_HOSTS)
    run_dir = tmp_path / "disturbed"
    # The worker on the host to lose stops in epoch 4's fourth step (7 steps per epoch), so the
    # last commit before it is lost is the one after step 2: inside the epoch, not at its start.
    held = tmp_path / "held"
    with ended_whatever_happens(calm_job):
        job = start_elastic(ssh_hosts, hostfile, run_dir, HVDTRAIN_TEST_HOLD=f"{LOST_HOST}:{3 * 7 + 4}",
                            HVDTRAIN_TEST_HOLD_FILE=str(held))
        with ended_whatever_happens(job):
            wait_for(held.exists, 120, "the worker to lose to reach epoch 4, step 4")
            assert len(records(run_dir)) == 3
            os.kill(worker_on(LOST_HOST), signal.SIGKILL)
            wait_for(lambda: any(r["world_size"] == 2 for r in records(run_dir)), 120, "an epoch with 2 workers")
            write_hosts(hostfile, (*FIRST_HOSTS, NEW_HOST))  # a new slot: a worker starts there and joins
            code, out, err = finish(job, timeout=240)
            assert code == 0, out[-2000:] + err[-3000:]
        assert calm_job.wait(timeout=120) == 0, calm_log.read_text()[-3000:]

    calm = records(calm_dir)
    assert {r["world_size"] for r in calm} == {3}
    disturbed = records(run_dir)
    # Every epoch once, in order; three workers, then two, then three again.
    assert [r["epoch"] for r in disturbed] == list(range(1, EPOCHS + 1))
    sizes = [r["world_size"] for r in disturbed]
    changes = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert changes == [3, 2, 3], sizes
    # Rolled back to a commit inside epoch 4, not to its start.
    assert "elastic: 2 processes now (were 3); going on from epoch 4, sample " in out
    resumed_at = int(out.split("going on from epoch 4, sample ")[1].split()[0])
    assert resumed_at == 2 * 3 * 64, out  # 2 steps of the global batch of 3 x 64
    assert "elastic: 3 processes now (were 2)" in out
    final, reference = disturbed[-1]["val_acc"], calm[-1]["val_acc"]
    print(f"world sizes {sizes}; resumed at sample {resumed_at}; val_acc {final:.4f} against {reference:.4f}")
    assert abs(final - reference) <= 0.01, (final, reference)
    assert run_summary(run_dir)["val_acc"] == final


def test_a_stream_goes_on_with_the_samples_no_rank_had_served_when_a_worker_is_lost(ssh_hosts, tmp_path):
    """A user's IterableDataset (a stream: each rank reads its own range) on 3 workers, 8 steps of 3 x 64
    per epoch, 3 epochs; the worker on one host is lost in epoch 2's fourth step. The 2 left go on from the
    commit after step 2 with a plan of the epoch's samples no rank had served (not their old ranges): epoch
    2 still trains on all but one last partial global batch, and epoch 3, on 2 workers, on each sample once."""
    hostfile, run_dir, record, held = tmp_path / "hosts", tmp_path / "run", tmp_path / "record", tmp_path / "held"
    record.mkdir()
    write_hosts(hostfile, FIRST_HOSTS)
    job = start_elastic(ssh_hosts, hostfile, run_dir, "--data", "user_code:indexed_stream", "--model",
                        "user_code:paced_records", "--epochs", "3", "--set", "data.shuffle_buffer=100",
                        HVDTRAIN_TEST_HOLD=f"{LOST_HOST}:{8 + 4}", HVDTRAIN_TEST_HOLD_FILE=str(held),
                        HVDTRAIN_TEST_RECORD=str(record), HVDTRAIN_TEST_DROPOUT="0")
    with ended_whatever_happens(job):  # a held worker waits for ever
        wait_for(held.exists, 120, "the worker to lose to reach epoch 2, step 4")
        lost = worker_on(LOST_HOST)
        os.kill(lost, signal.SIGKILL)
        code, out, err = finish(job, timeout=240)
    assert code == 0, out[-2000:] + err[-3000:]
    assert [(r["epoch"], r["world_size"]) for r in records(run_dir)] == [(1, 3), (2, 2), (3, 2)]
    assert "elastic: 2 processes now (were 3); going on from epoch 2, sample 384 " in out, out[-2000:]
    trained = {int(path.stem): path.read_text().split() for path in record.iterdir()}
    survivors = [numbers for pid, numbers in trained.items() if pid != lost]
    last_epoch = [n for numbers in survivors for n in numbers[-12 * 64:]]  # 12 steps of 64 on each of 2
    assert len(set(last_epoch)) == len(last_epoch) == 1536
    second = set(trained[lost][8 * 64:]).union(*(numbers[8 * 64:-12 * 64] for numbers in survivors))
    assert len(second) >= 1600 - 2 * 64, len(second)  # what epoch 2 left out: under one global batch of 2


def test_elastic_without_the_elastic_launcher_is_one_clear_line(tmp_path):
    done = fit_under("horovodrun-gloo", "--elastic", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "hvdtrain: error:" in line]
    assert len(errors) == 1 and "--elastic needs processes started by horovodrun in elastic mode" in errors[0]
    assert not (tmp_path / "run").exists()


def test_the_torch_engine_under_the_elastic_launcher_is_one_clear_line(tmp_path):
    """horovodrun's elastic driver adds and replaces workers, which a fixed torch.distributed process
    group cannot follow (its new workers' rank 0 found the first ones' port taken). The discovery script
    lists this host alone: Horovod's driver waited for a second host, silently, until its 600 s timeout."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    job = subprocess.Popen(["horovodrun", "--gloo", "-np", "2", "--min-np", "1", "--host-discovery-script",
                            str(ROOT / "launch" / "discover-hosts.sh"), "hvdtrain", "fit", "--elastic", "--engine",
                            "torch", "--progress", "off", "--run-dir", str(tmp_path / "run")],
                           env={**launch_env(), "HOSTFILE": str(hostfile)}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    code, out, err = finish(job, timeout=120)
    errors = [line for line in (out + err).splitlines() if "hvdtrain: error:" in line]
    assert code != 0 and len(errors) == 1 and "elastic mode adds and replaces processes" in errors[0], err[-3000:]
    assert "Traceback" not in out + err and not (tmp_path / "run").exists()
    assert "horovodrun: the host discovery script lists this host alone: the job starts on it over the loopback " \
           "interface, which hosts added later cannot reach" in err  # no --max-np: it may grow


@pytest.mark.parametrize("script, slots, problem", [
    ("echo localhost:2; echo node-2:4", None, None),
    ("echo localhost", 2, None),  # the slots from --slots-per-host
    ("true", None, None),  # no host usable yet
    ("echo 'localhost slots=2'", None, "printed 'localhost slots=2' (a hostfile's form: print localhost:N): it must "
                                       "print one host:slots line per host now usable"),
    ("echo localhost", None, "printed 'localhost' (or give horovodrun --slots-per-host N)"),
    ("echo no hosts >&2; exit 3", None, "exited with status 3 (no hosts): it must exit 0"),
    ("no-such-command", None, "exited with status 127 ("),
    ("printf '\\377\\n'", None, "printed '\ufffd'"),  # not text: no UnicodeDecodeError
])
def test_a_discovery_script_horovod_cannot_read_is_named_with_what_it_printed(script, slots, problem, tmp_path):
    from hvdtrain.cli.elastic_launch import discovery_problem

    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    found = discovery_problem(str(path), slots)
    assert found == problem if problem is None else found.startswith(problem), found
    path.chmod(0o644)
    assert discovery_problem(str(path), slots).endswith("it could not be run (not executable? chmod +x it)")
    assert discovery_problem(str(tmp_path / "absent.sh"), slots).endswith("it, or a command in it, was not found")


def test_horovodrun_says_in_one_line_that_its_discovery_script_cannot_be_read(tmp_path):
    """Horovod's driver raised it in its discovery thread: two tracebacks, 'Job has been shutdown'."""
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\necho 'localhost slots=2'\n")
    path.chmod(0o755)
    done = run(["horovodrun", "--gloo", "-np", "2", "--min-np", "1", "--host-discovery-script", str(path), "hvdtrain",
                "fit", "--elastic", "--run-dir", str(tmp_path / "run")], timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"horovodrun: the host discovery script {path} printed 'localhost slots=2' (a hostfile's form: print "
        "localhost:N): it must print one host:slots line per host now usable")
    assert not (tmp_path / "run").exists()

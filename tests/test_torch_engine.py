"""The torch.distributed engine's own pieces: rank facts from each launcher, gradient buckets, and an
install with this engine alone (no MPI, no Horovod)."""

import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import ROOT, assert_ok, launch_env
from hvdtrain.engine.buckets import FIRST_BUCKET_BYTES, buckets as _buckets
from hvdtrain.engine.torch_distributed import launcher_facts

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x2),1",
         "SLURM_STEP_NUM_TASKS": "5"}


@pytest.mark.parametrize("node, local_size", [("0", 2), ("1", 2), ("2", 1)])
def test_srun_without_ntasks_per_node_gives_each_node_its_own_task_count(node, local_size, monkeypatch):
    for name in [*os.environ]:
        if name.startswith(("SLURM_", "OMPI_")) or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    for name, value in {**SLURM, "SLURM_NODEID": node}.items():
        monkeypatch.setenv(name, value)
    assert launcher_facts() == (3, 5, 0, local_size)


def test_two_steps_of_one_slurm_job_meet_at_different_ports(monkeypatch):
    """Two `srun` steps of one allocation may run at once on one node: each step's ranks meet at a port
    of their own (a port from the job id alone made the second step's rank 0 fail to bind)."""
    from hvdtrain.engine.environment import port_for_job

    for name in [*os.environ]:
        if name.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    ports = set()
    for step in range(8):
        monkeypatch.setenv("SLURM_STEP_ID", str(step))
        ports.add(port_for_job())
    assert len(ports) == 8 and all(29500 <= port < EPHEMERAL_PORTS_FROM for port in ports)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert port_for_job() not in ports  # the next job's step 7


def test_open_mpi_jobs_spread_over_every_port(monkeypatch):
    """Open MPI's job ids are a family number times 65536, plus 1: 1000 jobs get 1000 ports (a count
    of ports that shares a factor with 65536 gave them 375 in all), none among the ephemeral ones."""
    from hvdtrain.engine.environment import port_for_job

    _launched_with({}, monkeypatch)
    ports = set()
    for family in range(20000, 21000):
        monkeypatch.setenv("OMPI_MCA_ess_base_jobid", str(family * 65536 + 1))
        ports.add(port_for_job())
    assert len(ports) == 1000 and all(29500 <= port < EPHEMERAL_PORTS_FROM for port in ports)


# Linux's first ephemeral port: any outgoing connection on the host may hold one from here on, and a
# rank 0 that meant to listen there failed to bind (a Slurm job's port was, on a busy CI host).
EPHEMERAL_PORTS_FROM = 32768


def test_horovodrun_gloo_s_variables_give_the_torch_engine_its_ranks_and_a_port_of_the_run(monkeypatch):
    from hvdtrain.engine.environment import port_for_job

    for name in [*os.environ]:
        if name.startswith(("SLURM_", "OMPI_", "HOROVOD_", "PMI")):
            monkeypatch.delenv(name)
    for name, value in {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
                        "HOROVOD_GLOO_RENDEZVOUS_PORT": "17782"}.items():
        monkeypatch.setenv(name, value)
    assert launcher_facts() == (3, 4, 1, 2)
    first = port_for_job()
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", "17783")  # the next run's
    assert port_for_job() != first and all(29500 <= port < EPHEMERAL_PORTS_FROM for port in (first, port_for_job()))


def test_a_slurm_step_s_local_size_is_its_own_not_its_allocation_s(monkeypatch):
    """srun -n 2 inside an allocation of --ntasks-per-node=4: SLURM_NTASKS_PER_NODE is the allocation's."""
    _launched_with({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                    "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "4", "SLURM_STEP_TASKS_PER_NODE": "2"}, monkeypatch)
    assert launcher_facts() == (1, 2, 1, 2)


def test_a_launcher_s_variable_that_is_no_number_is_one_line(monkeypatch):
    from hvdtrain.errors import UserError

    _launched_with({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "two"}, monkeypatch)
    with pytest.raises(UserError, match="WORLD_SIZE='two' in the environment is not a number"):
        launcher_facts()


def test_torchrun_s_variables_come_first(monkeypatch):
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", **SLURM}.items():
        monkeypatch.setenv(name, value)
    assert launcher_facts() == (1, 4, 1, 2)


@pytest.mark.parametrize("variables, rank", [
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}, 2),  # plain srun: Slurm's own task number
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "PMIX_RANK": "2"}, 2),  # srun --mpi=pmix
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, None),  # the batch script itself, no step
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, None),  # a step of one task
], ids=["plain-srun", "srun-pmix", "batch-script", "one-task"])
def test_the_rank_before_any_engine_under_slurm(variables, rank, monkeypatch):
    from hvdtrain.engine import launcher_rank
    from hvdtrain.engine.environment import plain_srun_rank as _plain_srun_rank

    _launched_with(variables, monkeypatch)
    assert launcher_rank() == rank
    # dist: only where no MPI plugin set a rank does the torch engine take Slurm's
    assert (_plain_srun_rank() is not None) == (rank is not None and "PMIX_RANK" not in variables)


IN_A_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1"}


@pytest.mark.parametrize("variables, ends, step_left", [
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1"}, True, None),
    ({"HOROVOD_RANK": "1"}, True, None),  # horovodrun --gloo
    ({"HOROVOD_RANK": "1", "HOROVOD_ELASTIC": "1"}, False, None),  # its elastic driver carries on without one
    ({"OMPI_COMM_WORLD_RANK": "1"}, True, None),  # mpirun, horovodrun over MPI
    ({**IN_A_STEP, "OMPI_COMM_WORLD_RANK": "1"}, True, None),  # mpirun in an allocation (its daemons in a step)
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", **IN_A_STEP}, True, None),  # torchrun started by srun
    (IN_A_STEP, False, "7.1"),  # srun without --kill-on-bad-exit
    ({**IN_A_STEP, "PMIX_RANK": "1"}, False, "7.1"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, False, None),  # the batch script: no step
], ids=["torchrun", "horovodrun-gloo", "horovodrun-elastic", "mpirun", "mpirun-in-slurm", "torchrun-in-slurm", "plain-srun", "srun-pmix",
        "batch-script"])
def test_which_launchers_end_the_job_once_one_rank_fails(variables, ends, step_left, monkeypatch):
    """A quiet rank still there after its wait speaks only where rank 0's exit would have ended it; a
    rank 0 that cannot host the rendezvous ends the srun step that nothing else would end."""
    from hvdtrain.engine.environment import launcher_ends_the_job_on_a_failure, srun_step_left_waiting

    _launched_with(variables, monkeypatch)
    assert launcher_ends_the_job_on_a_failure() == ends
    assert srun_step_left_waiting() == step_left


TORCHRUN_2 = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
BATCH_SCRIPT = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("kind, variables, refused", [
    ("local", TORCHRUN_2, "--engine local trains in one process alone, but 2 were started"),
    ("local", {**TORCHRUN_2, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, None),
    ("local", BATCH_SCRIPT, None),  # the batch script's own process: one, whatever its allocation's tasks
    # salloc's shell (srun --preserve-env): a step of one task that keeps the allocation's SLURM_NTASKS
    ("local", {**BATCH_SCRIPT, "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}, None),
    ("horovod", TORCHRUN_2, "torchrun started 2 processes, which the Horovod engine cannot join"),
    ("horovod", {**TORCHRUN_2, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, None),  # a Horovod of one
    ("horovod", {**BATCH_SCRIPT, **IN_A_STEP}, "srun started 4 tasks without an MPI plugin"),
    ("torch", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_ELASTIC": "1"}, "elastic mode adds and replaces"),
    ("torch", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, None),
], ids=["local-torchrun", "local-torchrun-1", "local-batch-script", "local-salloc-shell", "horovod-torchrun", "horovod-torchrun-1",
        "horovod-plain-srun", "torch-elastic", "torch-horovodrun"])
def test_an_engine_that_cannot_join_the_launched_processes_is_refused(kind, variables, refused, monkeypatch):
    """Each process would be a run of its own, all in one run directory (two of them raced to write one)."""
    from hvdtrain.engine import _refuse_a_mismatch
    from hvdtrain.errors import UserError

    _launched_with(variables, monkeypatch)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name not in variables:
            monkeypatch.delenv(name, raising=False)
    if refused is None:
        _refuse_a_mismatch(kind)
    else:
        with pytest.raises(UserError, match=re.escape(refused)):
            _refuse_a_mismatch(kind)


@pytest.mark.parametrize("omp, torchrun, requested, threads", [
    (None, False, 0, "share"), ("3", False, 0, 3), ("3", True, 0, 3), ("1", False, 0, 1),
    ("1", True, 0, "share"),  # torchrun's own setting for several processes a host, unless the user's
    ("3", False, 2, 2), ("lots", False, 0, "share"), ("0", False, 0, "share")])
def test_threads_are_the_flag_s_then_the_user_s_omp_num_threads_then_a_share_of_the_cores(omp, torchrun, requested,
                                                                                          threads, monkeypatch):
    from hvdtrain.engine.environment import available_cores, threads_per_process

    for name, value in (("OMP_NUM_THREADS", omp), ("TORCHELASTIC_RUN_ID", "job" if torchrun else None)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    share = available_cores()  # one process on this host
    assert threads_per_process(requested, local_size=1) == (share if threads == "share" else threads)


def test_a_batch_script_s_own_process_is_no_launched_rank(monkeypatch):
    """Slurm gives a batch script task 0 of its allocation's tasks, but no step: `hvdtrain fit --engine
    torch` there waited for ranks nobody started until the rendezvous timeout."""
    _launched_with(BATCH_SCRIPT, monkeypatch)
    assert launcher_facts() is None


def test_only_a_rank_0_that_could_not_listen_leaves_the_others_waiting():
    """torch's words for a port rank 0 could not open, as against a rendezvous that began and failed."""
    from hvdtrain.engine.rendezvous import could_not_listen

    assert could_not_listen(torch.distributed.DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use"))
    assert could_not_listen(RuntimeError("The server socket has failed to bind to [::]:29500 (errno: 98 - Address "
                                          "already in use)."))
    assert not could_not_listen(torch.distributed.DistStoreError(
        "Timed out after 361 seconds waiting for clients. 1/2 clients joined."))


def test_a_user_s_error_that_speaks_of_a_connection_reset_is_not_another_rank_s_failure():
    """Only what torch.distributed or the engine raised is taken for a broken collective: a data set
    reading a network file system raised this, and it was taken for another rank's failure (the failed
    rank, its own error unsaid, left as a survivor)."""
    from hvdtrain.engine.torch_distributed import is_collective_failure

    def read_shard():
        raise RuntimeError("reading /mnt/nfs/part-1: Connection reset by peer")

    with pytest.raises(RuntimeError) as raised:
        read_shard()
    assert not is_collective_failure(raised.value)
    assert is_collective_failure(torch.distributed.DistNetworkError("Connection reset by peer"))


ENV_RENDEZVOUS = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456"}


@pytest.mark.parametrize("variables, facts", [
    (ENV_RENDEZVOUS, (1, 3, 0, 1)),  # a PyTorchJob's pod: one process on its host
    ({**ENV_RENDEZVOUS, "MASTER_ADDR": "127.0.0.1"}, (1, 3, 1, 3)),  # by hand on one host: every rank here
    ({**ENV_RENDEZVOUS, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 3, 1, 2)),  # as given
    ({**ENV_RENDEZVOUS, "WORLD_SIZE": "1", "RANK": "0"}, None),  # one process: no job of several
    ({**ENV_RENDEZVOUS, "RANK": "3"}, None),  # no rank of three
    ({**ENV_RENDEZVOUS, "RANK": ""}, None),  # RANK=$SLURM_PROCID outside a step
    ({k: v for k, v in ENV_RENDEZVOUS.items() if k != "MASTER_PORT"}, None),  # no rendezvous: left-over variables
    ({**ENV_RENDEZVOUS, "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1"}, "torchrun"),  # torchrun's, with its agent
    ({**ENV_RENDEZVOUS, "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, "mpirun"),  # left over under mpirun
    ({**ENV_RENDEZVOUS, **IN_A_STEP}, "srun"),  # left over under plain srun
], ids=["pod", "by-hand", "local-given", "one", "rank-out-of-range", "rank-empty", "no-port", "torchrun", "mpirun",
        "srun"])
def test_torch_s_env_rendezvous_without_a_launcher_is_a_job_of_fit_s_torch_engine(variables, facts, monkeypatch):
    """Processes started without a launcher but with torch's env:// variables (by hand, or one per pod of a
    Kubernetes PyTorchJob) each trained alone, in one run directory; fit's torch engine now joins them. The
    variables left in the environment under a launcher are not read for its ranks."""
    from hvdtrain.engine import LocalEngine, _refuse_a_mismatch, start_engine
    from hvdtrain.engine.environment import env_rendezvous_launched
    from hvdtrain.errors import UserError

    _launched_with(variables, monkeypatch)
    assert env_rendezvous_launched() == isinstance(facts, tuple)
    if facts == "torchrun":
        assert launcher_facts() == (1, 3, 1, 3)
    elif facts == "mpirun":
        assert launcher_facts() == (2, 4, 2, 4)
    elif facts == "srun":
        assert launcher_facts()[:2] == (1, 4)
    elif facts is not None:
        assert launcher_facts() == facts
        with pytest.raises(UserError, match="is torch's env:// rendezvous, which the Horovod engine cannot join"):
            _refuse_a_mismatch("horovod")
        with pytest.raises(UserError, match=r"--engine local trains in one process alone, but RANK, WORLD_SIZE=3"):
            _refuse_a_mismatch("local")
        # not fit (evaluate in a shell of the pod, say): alone, not a rank of the job under way
        assert isinstance(start_engine(device="cpu", keep_freed_memory=False), LocalEngine)


TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_a_survivor_says_why_it_ends_where_no_launcher_names_the_rank_that_left(monkeypatch, capsys):
    """Without a launcher (torch's env://, a PyTorchJob's pods) rank 1, whose collective broke off as rank 0
    died, ended with status 76 and no word in its log. Under torchrun or srun it stays silent: the launcher
    names the failed rank, or one log holds rank 0's note."""
    from hvdtrain.errors import ANOTHER_RANK_FAILED
    from hvdtrain.train import survivors

    monkeypatch.setattr(survivors, "_wait_for_the_launcher", lambda seconds: None)
    for variables, said in ((ENV_RENDEZVOUS, True), ({**TORCHRUN_2, "RANK": "1"}, False), (IN_A_STEP, False)):
        _launched_with(variables, monkeypatch)
        with pytest.raises(SystemExit) as leaving:
            survivors.leave_after_another_rank(RuntimeError("Connection closed by peer"), 1, debug=False)
        assert leaving.value.code == ANOTHER_RANK_FAILED
        err = capsys.readouterr().err
        assert err.startswith("hvdtrain: rank 1: the job stopped") if said else err == "", (variables, err)


def _launched_with(variables: dict[str, str], monkeypatch) -> None:
    """This process's environment as a launcher that sets only `variables` would leave it."""
    for name in [*os.environ]:
        if name.startswith(("SLURM_", "OMPI_", "PMI", "HOROVOD_", "TORCHELASTIC_")) or name in TORCH_VARIABLES:
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_buckets_follow_backward_order_and_start_small():
    """Reversed registration order; the first bucket closes after 1 MB so communication starts early."""
    sizes = [10, 400_000, 300_000, 5, 2_000_000]  # float32 elements
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes][::-1]
    buckets = _buckets(params)
    assert [[p.numel() for p in bucket] for bucket in buckets] == [[2_000_000], [5, 300_000, 400_000, 10]]
    assert buckets[0][0].numel() * 4 >= FIRST_BUCKET_BYTES
    half = [torch.nn.Parameter(torch.zeros(8, dtype=torch.float16)), torch.nn.Parameter(torch.zeros(8))]
    assert [len(b) for b in _buckets(half)] == [1, 1]  # one dtype per bucket


@pytest.mark.system
@pytest.mark.timeout(600)
def test_install_for_the_torch_engine_alone_trains_under_torchrun(tmp_path):
    """launch/install.sh --engine torch into a new environment: no Horovod, no mpi4py, and torchrun trains."""
    venv = tmp_path / "venv"
    env = {name: value for name, value in launch_env().items() if name != "PYTHONPATH"}
    _venv_with_torch_alone(venv, tmp_path / "torch-alone")
    started = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "launch" / "install.sh"), "--engine", "torch", "--venv", str(venv)],
                          env=env, capture_output=True, text=True, timeout=540)
    seconds = time.monotonic() - started
    assert_ok(done)
    assert "torch.distributed engine only (no Horovod)" in done.stdout and "building Horovod" not in done.stdout
    python = str(venv / "bin" / "python")
    absent = subprocess.run([python, "-c", "import horovod"], capture_output=True, text=True)
    assert absent.returncode != 0 and not (venv / "bin" / "horovodrun").exists()
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    fit = subprocess.run([str(venv / "bin" / "torchrun"), "--nproc-per-node", "2", "hvdtrain", "fit", "--epochs", "1",
                          "--progress", "off", "--run-dir", str(tmp_path / "run")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert_ok(fit)
    assert "controller gloo" in fit.stderr and (tmp_path / "run" / "summary.json").exists()
    print(f"install.sh --engine torch: {seconds:.0f} s")


def _venv_with_torch_alone(venv, packages):
    """A new environment that already imports torch and its requirements (from this environment, linked)
    and nothing else: install.sh's torch step, the same for both engines, is make test's own install;
    unpacking torch again cost this test 40 s of the suite."""
    def with_requirements(name, found):
        key = canonicalize_name(name)
        if key in found or key in ("setuptools", "pip"):  # the new environment has its own
            return
        try:
            found[key] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return
        for requirement in map(Requirement, found[key].requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                with_requirements(requirement.name, found)

    found = {}
    for name in ("torch", "numpy"):
        with_requirements(name, found)
    packages.mkdir()
    for distribution in found.values():
        for top in {file.parts[0] for file in distribution.files}:
            source = distribution.locate_file(top)
            if top not in ("..", "__pycache__") and not top.endswith(".pth") and not (packages / top).exists():
                (packages / top).symlink_to(source)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "torch-alone.pth").write_text(f"{packages}\n")


_SCRIPTS_GROUP = """
import os, tempfile, torch, torch.distributed as dist
from hvdtrain.engine.torch_distributed import TorchEngine
from hvdtrain.errors import UserError
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
os.environ.update(TORCHELASTIC_RUN_ID="x", RANK="0", WORLD_SIZE="{size}", LOCAL_RANK="0", LOCAL_WORLD_SIZE="{size}",
                  HVDTRAIN_INIT_METHOD="unused: the script's group needs no rendezvous")
try:
    for finished in (True, False, True):  # a sweep: the second fit fails, and the third is refused
        engine = TorchEngine.start(torch.device("cpu"))
        print("joined", engine.describe(), engine.allreduce_sum(torch.ones(1), "t").item())
        engine.shutdown(finished=finished)
        print("left to the script:", dist.is_initialized())
except UserError as err:
    print("refused:", err)
"""


@pytest.mark.parametrize("size, said", [
    (1, "joined rank 0/1 local_rank 0/1 device cpu controller gloo threads"),
    (2, "refused: rank 0: this script's own process group makes it rank 0 of 1, and the launcher started it as "
        "rank 0 of 2: init_process_group with the launcher's RANK and WORLD_SIZE (its defaults do), or leave the "
        "process group to hvdtrain"),
])
def test_a_script_s_own_process_group_is_joined_and_left_to_it_or_refused_where_it_is_not_the_launcher_s(size, said):
    """Joined whatever hvdtrain's own rendezvous settings say, left running after each fit, and refused after a fit
    that failed in it (its ranks may be out of step), as hvdtrain's own group is."""
    done = subprocess.run([sys.executable, "-c", _SCRIPTS_GROUP.format(size=size)], env=launch_env(),
                          capture_output=True, text=True, timeout=60)
    assert said in done.stdout, done.stdout + done.stderr[-2000:]
    if size == 1:
        assert done.stdout.count("rendezvous (the script's own process group) 1.0") == 2
        assert done.stdout.count("left to the script: True") == 2
        assert done.stdout.strip().endswith("refused: rank 0: an earlier fit or evaluate in this process failed and "
                                            "left its process group: start the next one in a launch of its own")

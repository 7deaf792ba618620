"""Optimizer state sharded across ranks (`--shard-optimizer`): the partition, the checkpoint's pieces,
the refusals, and, for real under horovodrun, mpirun and torchrun, the same weights as unsharded and a
resume on another number of processes, sharded or not.

The model is tests/user_code.py `signals_itself` (the built-in MLP, 4 parameter tensors), which sends
itself SIGTERM at a chosen step; no dropout, so that runs on different world sizes can agree.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import LAUNCHERS, assert_ok, assert_same_weights, final_weights, fit_under, requires_launchers, run
from hvdtrain.config import Config
from hvdtrain.engine.sharded import deal, held_bytes
from hvdtrain.errors import UserError
from hvdtrain.io.checkpoint import CheckpointStore

# 1600 training samples; AdamW's runs accumulate 2, a global batch of 192 (48 a rank at np=2, 32 at np=3,
# 24 at np=4, 96 at np=1): 8 optimizer steps (16 forward passes a rank) an epoch.
ARGS = ["--data", "random", "--set", "data.samples=2000", "--set", "data.features=12", "--epochs", "3",
        "--batch-size", "48", "--threads", "1", "--model", "user_code:signals_itself", "--no-scale-lr",
        "--set", "run.stop_check_seconds=0"]
FORWARDS_PER_EPOCH = 16
SGD = ["--optimizer", "sgd", "--set", "optim.momentum=0.9", "--lr", "0.05"]
ADAMW = ["--optimizer", "adamw", "--lr", "0.003", "--clip-grad-norm", "0.5", "--accumulate", "2"]
UNDER = {**LAUNCHERS, "mpirun4": ["mpirun", "-np", "4", "--oversubscribe"],
         "mpirun3": ["mpirun", "-np", "3", "--oversubscribe"], "torchrun1": ["torchrun", "--nproc-per-node", "1"],
         "horovodrun1": ["horovodrun", "-np", "1"]}


def fit(launcher: str, run_dir: Path, *args: str, signal_at: str = "", overflow_at: str = "") -> subprocess.CompletedProcess:
    """`hvdtrain fit` of the module's job; `signal_at` and `overflow_at` as tests/user_code.py `signals_itself`."""
    env = {"HVDTRAIN_TEST_SIGNAL": signal_at, "HVDTRAIN_TEST_DROPOUT": "0", "HVDTRAIN_TEST_OVERFLOW": overflow_at}
    prefix = UNDER[launcher]
    if launcher.startswith("mpirun"):
        prefix = [*prefix, *(arg for name in env for arg in ("-x", name))]
    return run([*prefix, "hvdtrain", "fit", "--progress", "off", *ARGS, *args, "--run-dir", str(run_dir)],
               env=env, timeout=240)


# --- in one process


def _params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]


def test_every_parameter_has_one_owner_and_equal_parameters_are_dealt_out_evenly():
    params = _params(*[(64, 64)] * 8, (64,), (10, 64), (10,))
    for size in (1, 2, 3, 4):
        shares = deal(params, size)
        owners = [owner for share in shares for owner in share.owners]
        assert sorted(id(p) for share in shares for p in share.params) == sorted(id(p) for p in params)
        assert set(owners) == set(range(size)) or size > len(params)
        for share in shares:  # each rank's part of a bucket fits in the bucket's segment
            for rank in range(size):
                mine = share.owned_by(rank)
                assert sum(share.params[i].numel() + 1 for i in mine) <= share.segment
        assert [s.owners for s in shares] == [s.owners for s in deal(params, size)]  # the same on every call
    held = held_bytes(params, 2, {p: 2 * p.numel() * 4 for p in params}, sharded=True)
    whole = held_bytes(params, 2, {p: 2 * p.numel() * 4 for p in params}, sharded=False)
    assert [h["parameters"] for h in held] == [whole[0]["parameters"]] * 2
    assert sum(h["optimizer_state"] for h in held) == whole[0]["optimizer_state"]
    assert max(h["optimizer_state"] for h in held) <= 0.55 * whole[0]["optimizer_state"]


@pytest.mark.parametrize("extra, says", [
    ({"adasum": True}, "does not work with train.adasum"),
    ({"elastic": True}, "does not work with train.elastic"),
])
def test_sharding_refuses_what_it_cannot_do_in_one_line(extra, says):
    with pytest.raises(UserError, match=says):
        Config.from_dict({"train": {"shard_optimizer": True, **extra}})


def test_a_checkpoint_in_pieces_loads_whole_and_a_broken_piece_means_an_older_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)

    def save(epoch: int, value: float) -> None:
        name = store.file_name(epoch, 0)
        pieces = [store.save_piece(name, 1, {"state": {1: {"momentum_buffer": torch.full((3,), value)}}})]
        state = {"model": {}, "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2)}}, "param_groups": []},
                 "epoch": epoch, "step": epoch, "optimizer_pieces": pieces}
        store.save(state, epoch, {"val_loss": 1.0 / epoch})

    for epoch in (1, 2, 3):
        save(epoch, float(epoch))
    names = sorted(p.name for p in store.dir.iterdir() if p.name.startswith("epoch-"))
    assert names == ["epoch-0002.pt", "epoch-0002.pt.rank-1.optim", "epoch-0003.pt", "epoch-0003.pt.rank-1.optim"]
    whole = CheckpointStore.load(store.latest_valid())
    assert sorted(whole["optimizer"]["state"]) == [0, 1]
    assert whole["optimizer"]["state"][1]["momentum_buffer"].tolist() == [3.0] * 3
    (store.dir / "epoch-0003.pt.rank-1.optim").write_bytes(b"torn")
    warnings: list[str] = []
    assert store.latest_valid(warn=warnings.append).name == "epoch-0002.pt"
    assert "epoch-0003.pt.rank-1.optim is corrupt or truncated" in warnings[0]
    with pytest.raises(UserError, match="does not match its sha256"):
        CheckpointStore.load(store.dir / "epoch-0003.pt")


# --- for real, several processes


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory) -> dict[str, Path]:
    """The unsharded runs every sharded one is held against (2 processes; weights are the same under
    either engine)."""
    made = {}
    for name, args in (("sgd", SGD), ("adamw", ADAMW)):
        made[name] = tmp_path_factory.mktemp(f"unsharded-{name}") / "run"
        assert_ok(fit("horovodrun-gloo", made[name], *args))
    return made


@pytest.fixture(scope="module")
def sharded_adamw_torchrun(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The sharded AdamW run under torchrun, uninterrupted: held against the unsharded one, and the run a
    sharded resume must end as."""
    run_dir = tmp_path_factory.mktemp("sharded-adamw") / "run"
    return run_dir, assert_ok(fit("torchrun", run_dir, *ADAMW, "--shard-optimizer"))


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun", "torchrun"])
def test_sharded_ends_with_the_unsharded_weights(launcher, unsharded, sharded_adamw_torchrun, tmp_path):
    """SGD with momentum, and AdamW with clipping (the global norm of every rank's share) and accumulation:
    each rank stepped its own share and got the others', and the weights are the unsharded run's."""
    for name, args in (("sgd", SGD), ("adamw", ADAMW)):
        run_dir = tmp_path / name
        if (launcher, name) == ("torchrun", "adamw"):
            run_dir, done = sharded_adamw_torchrun
        else:
            done = assert_ok(fit(launcher, run_dir, *args, "--shard-optimizer"))
        assert_same_weights(final_weights(unsharded[name]), final_weights(run_dir), atol=1e-6)
        assert done.stderr.count("holds parameters") == 2, done.stderr[-2000:]
        pieces = sorted(p.name for p in (run_dir / "checkpoints").glob("*.optim"))
        assert pieces == ["epoch-0001.pt.rank-1.optim", "epoch-0002.pt.rank-1.optim", "epoch-0003.pt.rank-1.optim"]
        saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["state"]
        assert 0 < len(saved) < 4  # rank 0's share only: the rest is in the piece
        whole = CheckpointStore.load(run_dir / "checkpoints" / "last.pt")["optimizer"]["state"]
        expected = CheckpointStore.load(unsharded[name] / "checkpoints" / "last.pt")["optimizer"]["state"]
        assert sorted(whole) == sorted(expected) == [0, 1, 2, 3]
        for index in expected:
            for key, value in expected[index].items():
                assert torch.allclose(whole[index][key], value, atol=1e-6), (index, key)


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
def test_sharded_on_four_processes_and_on_one(tmp_path):
    """np=4 (each rank owns one of the 4 parameter tensors) and np=1, each against its unsharded run."""
    batch = {"mpirun4": "24", "horovodrun1": "96"}
    for launcher, against in (("mpirun4", "mpirun4"), ("horovodrun1", "torchrun1")):
        args = [*ADAMW, "--batch-size", batch[launcher]]
        assert_ok(fit(against, tmp_path / f"{launcher}-whole", *args))
        assert_ok(fit(launcher, tmp_path / launcher, *args, "--shard-optimizer"))
        assert_same_weights(final_weights(tmp_path / f"{launcher}-whole"), final_weights(tmp_path / launcher), 1e-6)


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
def test_a_sharded_run_stopped_inside_an_epoch_resumes_on_any_world_size_sharded_or_not(sharded_adamw_torchrun,
                                                                                      tmp_path):
    """SIGTERM to rank 1 inside epoch 2 at np=2; resumed at np=2 (exact), at np=1 and at np=3 sharded, and
    at np=2 unsharded: each ends with the uninterrupted sharded run's weights."""
    whole, _ = sharded_adamw_torchrun
    stopped = tmp_path / "stopped"
    done = fit("horovodrun-gloo", stopped, *ADAMW, "--shard-optimizer",
               signal_at=f"1:{FORWARDS_PER_EPOCH + 9}:SIGTERM")  # in epoch 2's fifth step
    assert done.returncode == 75, done.stderr[-3000:]
    assert list((stopped / "checkpoints").glob("epoch-0002-sample-*.pt.rank-1.optim"))
    for launcher, batch, shard, atol in (("horovodrun-gloo", "48", True, 0.0), ("horovodrun1", "96", True, 1e-5),
                                         ("mpirun3", "32", True, 1e-5), ("torchrun", "48", False, 1e-5)):
        copy = tmp_path / f"{launcher}-{shard}"
        shutil.copytree(stopped, copy)
        resumed = assert_ok(fit(launcher, copy, *ADAMW, "--batch-size", batch, "--resume",
                                *(["--shard-optimizer"] if shard else [])))
        assert "samples into epoch 2" in resumed.stdout
        assert_same_weights(final_weights(whole), final_weights(copy), atol=atol)


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
def test_fp16_an_overflow_in_one_rank_s_share_skips_the_step_on_every_rank(tmp_path):
    """fp16 with its gradient scaler and fp16 on the wire: rank 1's gradient overflows at its 5th forward
    pass; only its owner sees the inf after the reduce-scatter, yet every rank skips that step and lowers
    the scale, as unsharded: the same weights and the same scale."""
    args = [*SGD, "--precision", "fp16", "--compression", "fp16"]
    for name, shard in (("whole", []), ("sharded", ["--shard-optimizer"])):
        assert_ok(fit("torchrun", tmp_path / name, *args, *shard, overflow_at="5"))
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "sharded"), atol=1e-6)
    scales = [torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)["scaler"]["scale"]
              for name in ("whole", "sharded")]
    assert scales[0] == scales[1] < 65536.0


FULL_DISK_ON_PIECES = """
import errno, sys
import hvdtrain.io.checkpoint as checkpoint
def full(self, name, rank, piece):
    raise OSError(errno.ENOSPC, "No space left on device")
checkpoint.CheckpointStore.save_piece = full
from hvdtrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.multiprocess
@requires_launchers
def test_a_piece_that_cannot_be_written_stops_every_rank_with_one_line(tmp_path):
    """A full disk while rank 0 writes rank 1's share: one line, every rank stops, no checkpoint half-made."""
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_ON_PIECES)
    done = run([*LAUNCHERS["torchrun"], str(script), "fit", "--epochs", "2", "--progress", "off", "--shard-optimizer",
                "--run-dir", str(tmp_path / "run")], timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("could not write a checkpoint into") == 1 and "Traceback" not in done.stderr
    assert not list((tmp_path / "run").glob("checkpoints/epoch-*"))


@pytest.mark.multiprocess
@requires_launchers
def test_a_refused_combination_is_one_line_and_writes_nothing(tmp_path):
    done = fit_under("horovodrun-gloo", "--shard-optimizer", "--adasum", "--run-dir", str(tmp_path / "run"))
    assert done.returncode != 0
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "shard_optimizer" in line]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()

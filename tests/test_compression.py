"""Compressed gradients. bf16 on the wire (`--compression bf16`): an all-to-all of bf16 values summed in
fp32, then an all-gather of the bf16 averages, on both engines (hvdtrain/engine/segments.py). Trained for
real under horovodrun, mpirun and torchrun: the same weights on every launcher, sharded or not, and
digits' accuracy within half a point of fp32's. PowerSGD (`--compression powersgd`): the same weights on
both engines, and its state in checkpoints, so a stop inside an epoch resumes exactly."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import assert_ok, assert_same_weights, final_weights, fit_ok, requires_launchers, run, run_summary
from hvdtrain.cli import main
from hvdtrain.config import Config
from hvdtrain.errors import UserError
from hvdtrain.tools.plan import sent_per_step

NP3 = {"horovodrun-gloo": ["horovodrun", "--gloo", "-np", "3"], "torchrun": ["torchrun", "--nproc-per-node", "3"]}


@pytest.mark.parametrize("compression, extra, says", [
    ("bf16", {"adasum": True}, "is bf16, which does not work with train.adasum"),
    ("bf16", {"elastic": True}, "is bf16, which does not work with train.elastic"),
    ("powersgd", {"adasum": True}, "is powersgd, which does not work with train.adasum"),
    ("powersgd", {"elastic": True}, "is powersgd, which does not work with train.elastic"),
    ("powersgd", {"shard_optimizer": True}, "is powersgd, which does not work with train.shard_optimizer"),
    ("powersgd", {"powersgd_rank": 0}, "train.powersgd_rank' must be 1 or more, got 0"),
])
def test_a_compression_refuses_what_it_cannot_do_in_one_line(compression, extra, says):
    with pytest.raises(UserError, match=says):
        Config.from_dict({"train": {"compression": compression, **extra}})


def test_plan_says_what_each_rank_sends_per_step_with_each_compression(capsys):
    whole, sharded = sent_per_step(4000, 4, sharded=False, powersgd_bytes=400), sent_per_step(4000, 4, sharded=True)
    assert whole == {"none": 6000, "fp16": 3000, "bf16": 3000, "powersgd": 600}  # 2 (N-1)/N of what is summed
    assert sharded == {"none": 6000, "fp16": 4500, "bf16": 4500}  # the parameters' all-gather stays fp32
    assert sent_per_step(4000, 1, sharded=False)["none"] == 0
    main(["plan", "--np", "4", "--compression", "bf16"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sent per optimizer step"))
    assert "with none, " in line and "with bf16 (this run), " in line and "with powersgd" in line, line


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
def test_bf16_on_the_wire_trains_as_fp32_does_with_the_same_weights_on_every_launcher(digits_torchrun, tmp_path):
    """Digits, 3 epochs, np=2: horovodrun (Gloo), mpirun (MPI) and torchrun end bit for bit alike, with
    weights that are not fp32's (the rounding happened) and val_acc within 0.5 points of fp32's."""
    runs = {}
    for launcher in ("horovodrun-gloo", "mpirun", "torchrun"):
        runs[launcher] = tmp_path / launcher
        fit_ok(launcher, "--epochs", "3", "--compression", "bf16", "--progress", "off", "--run-dir",
               str(runs[launcher]))
    for launcher in ("mpirun", "torchrun"):
        assert_same_weights(final_weights(runs["horovodrun-gloo"]), final_weights(runs[launcher]), atol=0.0)
    fp32_dir, _ = digits_torchrun
    fp32, bf16 = final_weights(fp32_dir), final_weights(runs["torchrun"])
    assert max((fp32[name] - bf16[name]).abs().max().item() for name in fp32) > 0
    assert abs(run_summary(runs["torchrun"])["val_acc"] - run_summary(fp32_dir)["val_acc"]) <= 0.005


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(600)
def test_bf16_with_the_optimizer_sharded_ends_with_the_unsharded_weights(tmp_path):
    """np=3 (segments padded), AdamW with accumulation and clipping: unsharded under horovodrun, sharded
    under torchrun, the same weights: the owner's average is rounded as the all-gathered one is."""
    args = ["hvdtrain", "fit", "--epochs", "2", "--compression", "bf16", "--optimizer", "adamw", "--accumulate", "2",
            "--clip-grad-norm", "1.0", "--progress", "off"]
    assert_ok(run([*NP3["horovodrun-gloo"], *args, "--run-dir", str(tmp_path / "whole")]))
    assert_ok(run([*NP3["torchrun"], *args, "--shard-optimizer", "--run-dir", str(tmp_path / "sharded")]))
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "sharded"), atol=0.0)


# --- PowerSGD

# tests/user_code.py `signals_itself` (the built-in MLP: two matrices compressed, two biases whole) sends
# itself SIGTERM at a chosen forward pass and can overflow fp16 at another; 1600 training samples, a
# global batch of 96 (48 a rank, accumulate 2 at np=2): 16 forward passes a rank an epoch.
POWERSGD = ["--data", "random", "--set", "data.samples=2000", "--set", "data.features=12", "--epochs", "3",
            "--batch-size", "48", "--threads", "1", "--model", "user_code:signals_itself", "--no-scale-lr",
            "--set", "run.stop_check_seconds=0", "--compression", "powersgd", "--optimizer", "adamw", "--lr", "0.003",
            "--accumulate", "2", "--clip-grad-norm", "0.5", "--precision", "fp16", "--progress", "off"]
FORWARDS_PER_EPOCH = 16
UNDER = {"horovodrun-gloo": ["horovodrun", "--gloo", "-np", "2"], "torchrun": ["torchrun", "--nproc-per-node", "2"],
         "torchrun3": ["torchrun", "--nproc-per-node", "3"]}


def powersgd_fit(launcher: str, run_dir, *args: str, signal_at: str = "", overflow_at: str = ""):
    env = {"HVDTRAIN_TEST_SIGNAL": signal_at, "HVDTRAIN_TEST_DROPOUT": "0", "HVDTRAIN_TEST_OVERFLOW": overflow_at}
    return run([*UNDER[launcher], "hvdtrain", "fit", *POWERSGD, *args, "--run-dir", str(run_dir)], env=env, timeout=240)


def test_powersgd_sends_factors_of_matrices_and_small_tensors_whole():
    from hvdtrain.engine.powersgd import compressed_rank, sent_values

    weight, bias, conv, thin = torch.zeros(64, 12), torch.zeros(64), torch.zeros(16, 8, 3, 3), torch.zeros(3, 2)
    assert [compressed_rank(t, 2) for t in (weight, bias, conv, thin)] == [2, 0, 2, 0]
    assert sent_values([weight, bias, conv, thin], 2) == (64 + 12) * 2 + 64 + (16 + 72) * 2 + 6
    assert compressed_rank(weight, 100) == 0  # factors of rank 12 are no smaller than the matrix


class _Alone:
    """Collectives of one rank: what is sent is what comes back."""

    rank, size = 0, 1

    def all_to_all(self, flat, name):
        return flat

    def all_gather(self, segment, name):
        return segment

    def wait(self, handle):
        return handle


def test_a_skipped_step_or_an_unused_matrix_leaves_powersgd_s_state_as_it_was():
    """An overflow (its step is skipped) must not fold an inf into the errors or the factors, and a
    matrix no rank computed keeps no gradient and its state; the next finite step goes on from there."""
    from hvdtrain.engine.powersgd import PowerSGD

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(16, 8)), torch.nn.Parameter(torch.zeros(16))]
    powersgd = PowerSGD(params, _Alone(), 2, seed=0, loss_scale=lambda: 1024.0)

    def state():
        return [t.clone() for t in (*powersgd.errors.values(), *powersgd.factors.values())]

    for param in params:
        param.grad = torch.randn_like(param) * 1024
    powersgd.wait()
    before = state()
    assert before[0].abs().sum() > 0  # rank 2 of an 8-column matrix leaves something out
    params[0].grad, params[1].grad = torch.full((16, 8), float("inf")), torch.randn(16)
    powersgd.wait()
    assert not params[0].grad.isfinite().all()  # so the step is skipped
    assert all(torch.equal(a, b) for a, b in zip(before, state()))
    params[0].grad, params[1].grad = None, torch.randn(16)
    powersgd.wait()
    assert params[0].grad is None and all(torch.equal(a, b) for a, b in zip(before, state()))
    for param in params:
        param.grad = torch.randn_like(param) * 1024
    powersgd.wait()
    assert not all(torch.equal(a, b) for a, b in zip(before, state()))


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.timeout(900)
def test_powersgd_stopped_inside_an_epoch_resumes_exactly_on_either_engine(tmp_path):
    """AdamW with accumulation, clipping and fp16 with its scaler (an overflow on rank 1 at its 5th forward
    pass, in epoch 1: that step is skipped and PowerSGD's state left as it was). SIGTERM to rank 1 inside
    epoch 2 and --resume on as many processes, under either engine, ends with the weights of the
    uninterrupted run under horovodrun exactly, each rank's errors restored from the checkpoint's pieces;
    on 3 processes the state starts afresh, said in one line."""
    whole = tmp_path / "whole"
    assert_ok(powersgd_fit("horovodrun-gloo", whole, overflow_at="5"))
    for launcher in ("horovodrun-gloo", "torchrun"):
        stopped = tmp_path / launcher
        done = powersgd_fit(launcher, stopped, signal_at=f"1:{FORWARDS_PER_EPOCH + 9}:SIGTERM",  # epoch 2, step 5
                            overflow_at="5")
        assert done.returncode == 75, done.stderr[-3000:]
        inside = sorted((stopped / "checkpoints").glob("epoch-0002-sample-*.pt"))
        assert inside and (inside[0].parent / f"{inside[0].name}.rank-1.optim").is_file()
        saved = torch.load(inside[0], weights_only=True)["powersgd"]
        assert saved["world_size"] == 2 and all(error.abs().sum() > 0 for error in saved["errors"][0].values())
        if launcher == "torchrun":
            elsewhere = tmp_path / "three"
            shutil.copytree(stopped, elsewhere)
            other = assert_ok(powersgd_fit("torchrun3", elsewhere, "--batch-size", "32", "--resume"))
            assert other.stdout.count("PowerSGD's error buffers and factors start afresh: the checkpoint was "
                                      "written by 2 processes and this run has 3") == 1, other.stdout[-2000:]
        resumed = assert_ok(powersgd_fit(launcher, stopped, "--resume"))
        assert "samples into epoch 2" in resumed.stdout and "start afresh" not in resumed.stdout
        assert_same_weights(final_weights(whole), final_weights(stopped), atol=0.0)
    scale = torch.load(whole / "checkpoints" / "last.pt", weights_only=True)["scaler"]["scale"]
    assert scale < 65536.0  # the overflow happened, and its step was skipped

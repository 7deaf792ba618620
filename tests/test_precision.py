"""Precision modes and device choice: what runs on the CPU here; the GPU parts are marked `gpu`."""

import pytest
import torch
from torch import nn

from conftest import (LAUNCHERS, assert_ok, assert_same_weights, final_weights, fit_here, fit_ok, requires_launchers,
                      run, run_summary)
from hvdtrain.config import Config
from hvdtrain.engine import LocalEngine, _pick_device
from hvdtrain.errors import UserError
from hvdtrain.train.loop import apply_gradients
from hvdtrain.numerics.precision import Precision

CPU = torch.device("cpu")


def _fit(tmp_path, *args):
    return fit_here(tmp_path, "--data", "random", "--set", "data.samples=512", "--set", "data.features=16",
                    "--epochs", "3", "--device", "cpu", *args)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_low_precision_trains_on_cpu(mode, tmp_path):
    assert _fit(tmp_path, "--precision", mode)["val_acc"] > 0.6


def test_fp16_checkpoint_keeps_the_scaler_and_resumes(tmp_path):
    """The scaler counts the steps since its last overflow: a checkpoint holds the live count, and a
    resume goes on counting from it (a fresh scaler would count the resumed steps only)."""
    first = _fit(tmp_path / "r", "--precision", "fp16", "--epochs", "1")
    state = torch.load(tmp_path / "r" / "checkpoints" / "last.pt", weights_only=True)
    assert state["scaler"]["scale"] == 2.0 ** 16 and state["scaler"]["_growth_tracker"] == first["steps"] > 0
    done = _fit(tmp_path / "r", "--precision", "fp16", "--resume")
    state = torch.load(tmp_path / "r" / "checkpoints" / "last.pt", weights_only=True)
    assert state["scaler"]["_growth_tracker"] == done["steps"] == 3 * first["steps"]


def test_bf16_autocast_runs_the_forward_in_bf16():
    model = nn.Linear(4, 2)
    with Precision("bf16", CPU).autocast():
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16
    with Precision("32", CPU).autocast():
        assert model(torch.randn(3, 4)).dtype == torch.float32


def test_fp16_scaler_skips_a_step_whose_gradients_overflowed():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16", CPU)
    before = [p.detach().clone() for p in model.parameters()]
    scale = precision.scaler.get_scale()
    precision.backward(model(torch.randn(3, 4)).sum())
    model.weight.grad[0, 0] = float("inf")  # as after an allreduce that carried one rank's overflow
    apply_gradients(model, optimizer, LocalEngine(CPU), clip_grad_norm=1.0, precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # step skipped
    assert precision.scaler.get_scale() < scale  # and the scale backed off
    precision.backward(model(torch.randn(3, 4)).sum())
    apply_gradients(model, optimizer, LocalEngine(CPU), clip_grad_norm=1.0, precision=precision)
    assert not torch.equal(before[0], model.weight)  # a finite step goes through


def test_precision_from_yaml_number():
    assert Config.from_dict({"train": {"precision": 32}}).train.precision == "32"


def test_channels_last_and_compile_give_the_same_weights(tmp_path):
    common = ["--model", "cnn", "--data", "digits", "--set", "model.hidden=8", "--epochs", "1"]
    _fit(tmp_path / "plain", *common)
    _fit(tmp_path / "fast", *common, "--channels-last", "--compile")
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "fast"), atol=1e-4)


@pytest.mark.multiprocess
@requires_launchers
def test_a_channels_last_model_trains_on_both_engines_sharded_or_not_with_the_same_weights(tmp_path):
    """Horovod's collectives take contiguous tensors only, and a channels-last model's 4-D weights and
    gradients are not: under horovodrun the broadcast of rank 0's weights failed on every rank with a
    traceback (seen on a GPU). Each gradient must also come back in its weight's memory layout, sharded
    or not: AdamW's fused kernel, given another, steps wrongly without a word (0.06 here)."""
    common = ["--model", "cnn", "--set", "model.hidden=8", "--epochs", "1", "--channels-last", "--optimizer",
              "user_code:fused_adamw", "--lr", "0.003", "--accumulate", "2", "--progress", "off"]
    runs = {"torchrun": [], "horovodrun-gloo": [], "sharded": ["--shard-optimizer"]}
    for name, extra in runs.items():
        fit_ok("torchrun" if name == "torchrun" else "horovodrun-gloo", *common, *extra, "--run-dir",
               str(tmp_path / name))
    for name in ("horovodrun-gloo", "sharded"):
        assert_same_weights(final_weights(tmp_path / "torchrun"), final_weights(tmp_path / name), atol=0.0)
    # PowerSGD sets its gradients too: the fused kernel against the same AdamW without it (0.07 apart when the
    # gradients were contiguous), the one on the Horovod engine, the other on the torch engine.
    powersgd = [*common, "--compression", "powersgd"]
    fit_ok("horovodrun-gloo", *powersgd, "--run-dir", str(tmp_path / "powersgd-fused"))
    fit_ok("torchrun", *[a if a != "user_code:fused_adamw" else "user_code:foreach_adamw" for a in powersgd],
           "--run-dir", str(tmp_path / "powersgd-foreach"))
    assert_same_weights(final_weights(tmp_path / "powersgd-fused"), final_weights(tmp_path / "powersgd-foreach"),
                        atol=1e-6)


def test_cuda_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no GPU is visible: use --device cpu"):
        _pick_device("cuda", 0, 1)


def test_more_local_processes_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="4 processes on this host but only 2 visible GPU"):
        _pick_device("cuda", 3, 4)


@pytest.mark.multiprocess
@requires_launchers
def test_fp16_under_horovodrun(tmp_path):
    done = run([*LAUNCHERS["horovodrun-gloo"], "hvdtrain", "fit", "--precision", "fp16", "--epochs", "3",
                "--progress", "off", "--run-dir", str(tmp_path / "r")])
    assert_ok(done)
    assert run_summary(tmp_path / "r")["val_acc"] > 0.9


@pytest.mark.gpu
def test_each_process_uses_its_local_gpu(tmp_path):
    done = run(["hvdtrain", "fit", "--device", "cuda", "--precision", "bf16", "--epochs", "2", "--progress", "off",
                "--run-dir", str(tmp_path / "r")])
    assert_ok(done)
    assert "device cuda:0" in done.stderr
    assert run_summary(tmp_path / "r")["device"] == "cuda:0"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["32", "bf16", "fp16"])
def test_gpu_precisions_train(mode, tmp_path):
    summary = _gpu_fit(tmp_path, mode)
    assert summary["val_acc"] > 0.9


def _gpu_fit(tmp_path, mode):
    return fit_here(tmp_path, "--device", "cuda", "--precision", mode, "--model", "cnn", "--channels-last",
                    "--epochs", "5")

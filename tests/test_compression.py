"""Gradients on the wire in bf16 (`--compression bf16`): an all-to-all of bf16 values summed in fp32, then
an all-gather of the bf16 averages, on both engines (hvdtrain/engine/segments.py). Trained for real under
horovodrun, mpirun and torchrun: the same weights on every launcher, sharded or not, and digits' accuracy
within half a point of fp32's."""

from __future__ import annotations

import pytest

from conftest import assert_ok, assert_same_weights, final_weights, fit_ok, requires_launchers, run, run_summary
from hvdtrain.cli import main
from hvdtrain.config import Config
from hvdtrain.errors import UserError
from hvdtrain.tools.plan import sent_per_step

NP3 = {"horovodrun-gloo": ["horovodrun", "--gloo", "-np", "3"], "torchrun": ["torchrun", "--nproc-per-node", "3"]}


@pytest.mark.parametrize("extra, says", [
    ({"adasum": True}, "is bf16, which does not work with train.adasum"),
    ({"elastic": True}, "is bf16, which does not work with train.elastic"),
])
def test_bf16_refuses_what_it_cannot_do_in_one_line(extra, says):
    with pytest.raises(UserError, match=says):
        Config.from_dict({"train": {"compression": "bf16", **extra}})


def test_plan_says_what_each_rank_sends_per_step_with_each_compression(capsys):
    whole, sharded = sent_per_step(4000, 4, sharded=False), sent_per_step(4000, 4, sharded=True)
    assert whole == {"none": 6000, "fp16": 3000, "bf16": 3000}  # 2 (N-1)/N of the gradients
    assert sharded == {"none": 6000, "fp16": 4500, "bf16": 4500}  # the parameters' all-gather stays fp32
    assert sent_per_step(4000, 1, sharded=False)["none"] == 0
    main(["plan", "--np", "4", "--compression", "bf16"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sent per optimizer step"))
    assert "with none, " in line and "with bf16 (this run)" in line, line


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

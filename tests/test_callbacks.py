"""Callbacks and early stopping: the calls in order with the documented state, a stop asked on one
rank taken by every rank at the same step (both engines), early stopping at the expected epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HOROVOD_AND_TORCH, assert_ok, epoch_records, fit_under, requires_launchers, run_summary
from hvdtrain.cli import main

LOCAL = ["--progress", "off", "--engine", "local", "--threads", "1"]
SMALL = ["--data", "random", "--set", "data.samples=256", "--batch-size", "32"]  # 6 steps an epoch of 1 process


def calls(record: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{record}.{rank}").read_text().splitlines()]


def test_the_calls_arrive_in_order_with_the_documented_state(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_TEST_RECORD", str(tmp_path / "record"))
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, *SMALL, "--epochs", "2", "--callback", "user_code:Recorder", "--run-dir", str(run_dir)])
    seen = calls(tmp_path / "record", 0)
    steps = [c["step"] for c in seen if c["hook"] == "on_step_end"]
    per_epoch = len(steps) // 2
    assert steps == list(range(1, 2 * per_epoch + 1)) and per_epoch == 6
    expected = ["on_fit_start", *["on_step_end"] * per_epoch, "on_checkpoint", "on_epoch_end",
                *["on_step_end"] * per_epoch, "on_checkpoint", "on_epoch_end", "on_fit_end"]
    assert [c["hook"] for c in seen] == expected
    assert {(c["rank"], c["local_rank"], c["world_size"], c["run_dir"]) for c in seen} == {(0, 0, 1, str(run_dir))}
    assert {c["model"] for c in seen} == {"Sequential"}  # the model itself, not a wrapper
    by_hook = {c["hook"]: c for c in seen}
    assert by_hook["on_step_end"]["metrics"] == ["train_loss"]
    assert "val_loss" in by_hook["on_epoch_end"]["metrics"] and by_hook["on_epoch_end"]["epoch"] == 2
    assert by_hook["on_checkpoint"]["path"] == str(run_dir / "checkpoints" / "last.pt")
    assert by_hook["on_fit_end"]["stopped"] is None and by_hook["on_fit_start"]["metrics"] == []


def test_early_stopping_stops_at_the_epoch_patience_says(tmp_path, capsys):
    """The validation loss rises from epoch 1 on (its labels oppose the training rule): with a patience
    of 2, the run stops after epoch 3, with a checkpoint, and says why."""
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, "--data", "user_code:val_disagrees", "--model", "user_code:tiny_net", "--batch-size", "32",
          "--lr", "0.5", "--epochs", "20", "--early-stopping-patience", "2", "--set", "run.best_metric=val_loss",
          "--run-dir", str(run_dir)])
    records = epoch_records(run_dir)
    losses = [r["val_loss"] for r in records]
    assert [r["epoch"] for r in records] == [1, 2, 3] and losses == sorted(losses), losses
    summary = run_summary(run_dir)
    assert summary["stopped"] == (f"early stopping: val_loss has not improved for 2 epochs (best {losses[0]:.4f} "
                                  "at epoch 1)")
    assert summary["epochs"] == 3 and summary["planned_epochs"] == 20
    out = capsys.readouterr().out
    assert f"hvdtrain: stopped: {summary['stopped']}" in out and "after 3 epochs" in out
    assert (run_dir / "checkpoints" / "epoch-0003.pt").exists()


def test_a_callback_without_a_hook_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as leaving:
        main(["fit", *LOCAL, *SMALL, "--callback", "user_code:NoHooks", "--run-dir", str(tmp_path / "run")])
    assert leaving.value.code == 2
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hvdtrain: error: callback 'user_code:NoHooks' has none of the methods on_fit_start, on_step_end, "
        "on_epoch_end, on_checkpoint, on_fit_end; on_epoch_start is none of them: define at least one (each takes "
        "the state; see README, Callbacks)")


def test_a_hook_that_cannot_take_its_arguments_is_refused_before_training_not_at_its_first_call(tmp_path, capsys):
    """on_fit_end(self, state) failed with a TypeError once every epoch had been trained."""
    with pytest.raises(SystemExit) as leaving:
        main(["fit", *LOCAL, *SMALL, "--callback", "user_code:EndWithoutSummary", "--run-dir", str(tmp_path / "run")])
    assert leaving.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hvdtrain: error: callback 'user_code:EndWithoutSummary': EndWithoutSummary.on_fit_end(state) cannot be "
        "called as on_fit_end(state, summary), as hvdtrain calls it: give it those parameters (see README, Callbacks)")


def test_a_method_named_like_a_hook_that_hvdtrain_never_calls_is_warned_of(tmp_path, capsys):
    main(["fit", *LOCAL, *SMALL, "--epochs", "1", "--callback", "user_code:KerasNames", "--run-dir",
          str(tmp_path / "run")])
    assert ("hvdtrain: warning: hvdtrain never calls KerasNames.on_train_end: a callback's hooks are on_fit_start, "
            "on_step_end, on_epoch_end, on_checkpoint, on_fit_end (see README, Callbacks)") in capsys.readouterr().out


@pytest.mark.multiprocess
@requires_launchers
@pytest.mark.parametrize("launcher", HOROVOD_AND_TORCH)
def test_a_stop_asked_on_rank_one_alone_stops_every_rank_at_the_same_step(launcher, tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_TEST_RECORD", str(tmp_path / "record"))
    run_dir = tmp_path / "run"
    done = fit_under(launcher, *SMALL, "--set", "data.samples=1024", "--epochs", "3", "--callback",
                     "user_code:StopOnRankOne", "--set", "run.stop_check_seconds=0", "--run-dir", str(run_dir))
    assert_ok(done)
    ranks = [calls(tmp_path / "record", rank) for rank in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen[0]["hook"] == "on_fit_start" and seen[-1]["hook"] == "on_fit_end"
        assert [c["step"] for c in seen if c["hook"] == "on_step_end"] == [1, 2, 3, 4, 5], (rank, seen)
        assert {(c["rank"], c["world_size"]) for c in seen} == {(rank, 2)}
        assert seen[-1]["stopped"] == "rank one had seen enough (rank 1)"
    summary = run_summary(run_dir)
    assert summary["stopped"] == "rank one had seen enough (rank 1)"
    assert "hvdtrain: stopped: rank one had seen enough (rank 1)" in done.stdout + done.stderr
    import torch

    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 5 and saved["position"] == 5 * 64  # mid-epoch: --resume goes on from sample 320


def test_a_stop_before_the_first_epoch_s_end_says_where_it_stopped(tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(["fit", *LOCAL, *SMALL, "--epochs", "3", "--callback", "user_code:StopAtStepTwo", "--set",
          "run.stop_check_seconds=0", "--run-dir", str(run_dir)])
    summary = run_summary(run_dir)
    assert (summary["stopped"], summary["stopped_at_epoch"], summary["stopped_at_step"]) == ("two steps are enough", 1, 2)
    assert summary["epochs"] == 0 and summary["planned_epochs"] == 3
    out = capsys.readouterr().out
    assert "hvdtrain: stopped: two steps are enough; at epoch 1, step 2 (inside it: --resume continues there)" in out
    assert "nothing to do" not in out


@pytest.mark.multiprocess
@requires_launchers
def test_early_stopping_stops_every_rank_at_the_same_epoch(tmp_path):
    run_dir = tmp_path / "run"
    done = fit_under("torchrun", "--data", "user_code:val_disagrees", "--model", "user_code:tiny_net", "--batch-size",
                     "16", "--no-scale-lr", "--lr", "0.5", "--epochs", "20", "--early-stopping-patience", "2",
                     "--set", "run.best_metric=val_loss", "--run-dir", str(run_dir))  # one process x 32's curve
    assert_ok(done)
    summary = run_summary(run_dir)
    assert summary["stopped_at_epoch"] == 3 and summary["world_size"] == 2
    assert summary["stopped"].startswith("early stopping: val_loss has not improved for 2 epochs")
    assert "(rank" not in summary["stopped"]  # every rank asked alike: no rank to name


def test_early_stopping_resumed_keeps_the_best_epoch_so_far(tmp_path):
    """Stopped by early stopping at epoch 3, then resumed with more epochs: the best is still epoch 1,
    so it stops again at the next epoch's end instead of waiting `patience` more."""
    args = [*LOCAL, "--data", "user_code:val_disagrees", "--model", "user_code:tiny_net", "--batch-size", "32",
            "--lr", "0.5", "--early-stopping-patience", "2", "--set", "run.best_metric=val_loss",
            "--run-dir", str(tmp_path / "run")]
    main(["fit", *args, "--epochs", "20"])
    main(["fit", *args, "--epochs", "20", "--resume"])
    summary = run_summary(tmp_path / "run")
    assert summary["stopped_at_epoch"] == 4 and "at epoch 1)" in summary["stopped"]

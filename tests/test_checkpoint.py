"""Checkpoints survive crashes: atomic writes, a sha256 manifest, last K and best kept."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, launch_env
from hvdtrain.io.checkpoint import CheckpointStore, sha256_of
from hvdtrain.cli import main


def _state(epoch):
    return {"model": {"w": torch.full((10,), float(epoch))}, "optimizer": {}, "epoch": epoch, "step": 10 * epoch}


def test_keeps_the_last_k_and_the_best(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, best_metric="val_acc", maximize=True)
    for epoch, acc in enumerate([0.5, 0.9, 0.7, 0.6, 0.8], start=1):
        store.save(_state(epoch), epoch, {"val_acc": acc, "val_loss": 1 - acc})
    names = sorted(p.name for p in store.dir.glob("epoch-*.pt"))
    assert names == ["epoch-0002.pt", "epoch-0004.pt", "epoch-0005.pt"]  # best (0.9) + last two
    manifest = json.loads((store.dir / "manifest.json").read_text())
    assert manifest["best"] == "epoch-0002.pt"
    for entry in manifest["checkpoints"]:
        assert entry["sha256"] == sha256_of(store.dir / entry["file"])
    assert torch.load(store.dir / "best.pt", weights_only=True)["epoch"] == 2
    assert torch.load(store.dir / "last.pt", weights_only=True)["epoch"] == 5


def test_lower_loss_is_better(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1, best_metric="val_loss")
    for epoch, loss in enumerate([0.3, 0.1, 0.2], start=1):
        store.save(_state(epoch), epoch, {"val_acc": 0.0, "val_loss": loss})
    assert torch.load(store.dir / "best.pt", weights_only=True)["epoch"] == 2


def test_a_corrupt_newest_checkpoint_is_reported_and_skipped(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    for epoch in (1, 2, 3):
        store.save(_state(epoch), epoch, {"val_acc": 0.5, "val_loss": 1.0})
    newest = store.dir / "epoch-0003.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a disk that filled up
    warnings = []
    assert store.latest_valid(warnings.append) == store.dir / "epoch-0002.pt"
    assert warnings == [f"checkpoint {newest} is corrupt or truncated (its sha256 does not match manifest.json); "
                        "trying an older one"]


def test_without_a_manifest_the_newest_loadable_file_is_used(tmp_path):
    store = CheckpointStore(tmp_path)
    for epoch in (1, 2):
        store.save(_state(epoch), epoch, {"val_acc": 0.5, "val_loss": 1.0})
    (store.dir / "manifest.json").unlink()
    (store.dir / "epoch-0002.pt").write_bytes(b"garbage")
    assert store.latest_valid() == store.dir / "epoch-0001.pt"


@pytest.mark.timeout(240)
def test_killing_the_writer_at_any_moment_leaves_a_valid_checkpoint(tmp_path):
    """20 kills at different moments; after each, the newest valid checkpoint loads."""
    epoch, interrupted_writes = 1, 0
    for attempt in range(20):
        writer = subprocess.Popen([sys.executable, str(ROOT / "tests/workers/checkpoint_writer.py"), str(tmp_path),
                                   str(epoch)], env=launch_env(), stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.05 + 0.031 * attempt)  # a different moment of the write cycle each time
        interrupted_writes += any((tmp_path / "checkpoints").glob(".*.tmp"))
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        store = CheckpointStore(tmp_path, keep_last=2)
        path = store.latest_valid()
        if path is None:
            assert attempt < 3 and not list(store.dir.glob("epoch-*.pt")), "a checkpoint existed but none is valid"
            continue
        state = CheckpointStore.load(path)
        assert state["step"] == 10 * state["epoch"]
        epoch = state["epoch"] + 1
    assert epoch > 5, "the writer should have completed several checkpoints"
    assert interrupted_writes >= 3, "the kills should land mid-write several times"


def test_resume_skips_a_truncated_checkpoint(tmp_path, capsys):
    args = ["fit", "--data", "random", "--set", "data.samples=256", "--progress", "off", "--engine", "local",
            "--run-dir", str(tmp_path)]
    main([*args, "--epochs", "3"])
    truncated = tmp_path / "checkpoints" / "epoch-0003.pt"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    capsys.readouterr()
    main([*args, "--epochs", "4", "--resume"])
    out = capsys.readouterr().out
    assert f"checkpoint {truncated} is corrupt or truncated" in out
    assert "resuming from" in out and "epoch-0002.pt (epoch 2" in out
    assert [json.loads(line)["epoch"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]

"""Checkpoints survive crashes: atomic writes, a sha256 manifest, last K and best kept."""

import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_ok, epoch_records, launch_env
from hvdtrain.io.checkpoint import CheckpointStore, sha256_of
from hvdtrain.cli import main
from hvdtrain.errors import UserError
from hvdtrain.io.atomic import WriteFailed, atomic_write
from hvdtrain.io.run_dir import RunFiles
from hvdtrain.train.checkpointer import _Writer


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


class _FullDisk(io.RawIOBase):
    """A file on a file system that fills up after the first kilobyte."""

    written = 0

    def writable(self):
        return True

    def write(self, data):
        self.written += len(data)
        if self.written > 1024:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)


def test_a_checkpoint_cut_short_by_a_full_disk_says_so(tmp_path):
    """torch.save hides the write's ENOSPC behind `unexpected pos`: the line names the full disk instead."""
    with pytest.raises(RuntimeError) as saved:
        torch.save({"model": {"w": torch.zeros(1000)}}, _FullDisk())
    store = CheckpointStore(tmp_path)
    store.dir.mkdir()
    with pytest.raises(UserError) as failure:
        _Writer.failed(store, saved.value)
    assert "no space left on the device or over a quota (" in str(failure.value)
    assert "free there)" in str(failure.value) and "unexpected pos" not in str(failure.value)


def test_a_write_that_fills_the_disk_is_one_line_and_leaves_the_old_file(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")

    def full(handle):
        handle.write(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(WriteFailed, match=r"could not write .*summary.json: No space left on device \(.* free there\)"):
        atomic_write(target, full)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    with pytest.raises(WriteFailed, match="could not make the directory .*summary.json/sub: Not a directory"):
        atomic_write(target / "sub" / "file", full)


def test_only_a_failed_write_reads_as_one():
    """np.save's short write has no errno and is one; an errno-less OSError from elsewhere (TorchScript's
    "Can't get source") is not, and keeps its own message."""
    from hvdtrain.io.atomic import why_not_written

    assert why_not_written(OSError("1797 requested and 496 written"), Path("/")).endswith("free there)")
    assert why_not_written(OSError("Can't get source for <function f>"), Path("/")) is None
    assert why_not_written(ValueError("unexpected pos"), Path("/")) is None


def test_a_metrics_line_on_a_full_disk_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write to it fails with ENOSPC
    with pytest.raises(WriteFailed, match="could not write .*metrics.jsonl: No space left on device"):
        RunFiles(tmp_path).append_metrics({"epoch": 1})


def test_a_run_directory_removed_while_the_job_runs_is_said_so(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    files = RunFiles(run_dir)
    files.append_metrics({"epoch": 1})
    shutil.rmtree(run_dir)
    with pytest.raises(WriteFailed) as failed:
        files.append_metrics({"epoch": 2})
    assert str(failed.value) == (f"could not write {run_dir}/metrics.jsonl: its directory {run_dir} no longer exists "
                                 "(removed while the job ran?)")


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


def test_a_save_killed_at_any_of_its_steps_leaves_a_valid_checkpoint(tmp_path):
    """SIGKILL before each file-system step of a save in turn (the bytes half written, fsync, rename,
    manifest, links, deleting old files): the newest intact checkpoint is the one being written
    or the one before it, never none, and the next save in that directory works."""
    done = subprocess.run([sys.executable, str(ROOT / "tests/workers/checkpoint_writer.py"), str(tmp_path)],
                          env=launch_env(), capture_output=True, text=True, timeout=120)
    assert_ok(done)
    steps = int(done.stdout)
    assert steps >= 12, "a save has at least: two halves, fsync, rename, dir fsync, the manifest's, links, deletes"
    survivors = []
    for n in range(1, steps + 1):
        store = CheckpointStore(tmp_path / str(n), keep_last=2)
        path = store.latest_valid()
        assert path is not None, f"killed before step {n}: no valid checkpoint"
        state = CheckpointStore.load(path)
        assert state["epoch"] in (3, 4) and state["step"] == 10 * state["epoch"]
        assert torch.equal(state["model"]["w"], torch.full((250_000,), float(state["epoch"])))
        survivors.append(state["epoch"])
        # Atomic writes: a file under its final name is whole whenever it exists; only temporaries are torn.
        json.loads((store.dir / "manifest.json").read_text())
        for whole in [*store.dir.glob("epoch-*.pt"), store.dir / "last.pt", store.dir / "best.pt"]:
            CheckpointStore.load(whole)
        store.save(_state(5), 5, {"val_acc": 0.5, "val_loss": 1.0})  # the run goes on after a resume
        assert CheckpointStore.load(store.latest_valid())["epoch"] == 5
        assert not list(store.dir.glob(".*.tmp")), "a crash's temporary files are cleaned up by the next save"
    # Early kills keep epoch 3, late ones already have epoch 4: both sides of the commit were hit.
    assert survivors[0] == 3 and survivors[-1] == 4 and survivors == sorted(survivors)


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
    assert [r["epoch"] for r in epoch_records(tmp_path)] == [1, 2, 3, 4]


def test_resume_drops_a_torn_metrics_line_with_a_warning(tmp_path, capsys):
    """The machine stopped while metrics.jsonl was being appended to: resume warns and goes on."""
    args = ["fit", "--data", "random", "--set", "data.samples=256", "--progress", "off", "--engine", "local",
            "--run-dir", str(tmp_path)]
    main([*args, "--epochs", "2"])
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"epoch": 3, "epochs": 3, "step": 12, "train_lo')
    capsys.readouterr()
    main([*args, "--epochs", "3", "--resume"])
    captured = capsys.readouterr()
    assert f"warning: {tmp_path / 'metrics.jsonl'} line 3 is not a whole epoch record" in captured.out
    assert "Traceback" not in captured.out + captured.err
    assert [r["epoch"] for r in epoch_records(tmp_path)] == [1, 2, 3]


def test_a_resume_names_the_settings_that_differ_from_its_checkpoint_s_run(tmp_path, capsys):
    """A resume takes the command's settings: a flag left out of it is back to its default, said in one line.
    How the run goes (threads, data-loader workers, the engine, the run's own flags) is not named."""
    args = ["fit", "--data", "random", "--set", "data.samples=256", "--progress", "off", "--run-dir", str(tmp_path)]
    main([*args, "--epochs", "1", "--lr", "0.1", "--set", "task.label_smoothing=0.1", "--threads", "1",
          "--set", "data.num_workers=0", "--engine", "local"])
    capsys.readouterr()
    main([*args, "--epochs", "2", "--resume", "--set", "task.label_smoothing=0.1", "--set", "run.keep_last=2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "settings changed" in line]
    assert lines == ["hvdtrain: resuming with settings changed since that checkpoint: optim.lr 0.1 -> 0.05, "
                     "train.epochs 1 -> 2"]
    main([*args, "--epochs", "3", "--resume", "--set", "task.label_smoothing=0.1"])
    assert "settings changed since that checkpoint: train.epochs 2 -> 3\n" in capsys.readouterr().out


def test_resume_auto_starts_afresh_then_continues(tmp_path, capsys):
    """For requeued jobs: the same command line starts the run, then continues it."""
    args = ["fit", "--data", "random", "--set", "data.samples=256", "--progress", "off", "--engine", "local",
            "--run-dir", str(tmp_path / "run"), "--resume", "auto"]
    main([*args, "--epochs", "1"])
    assert "resuming from" not in capsys.readouterr().out
    main([*args, "--epochs", "2"])
    assert "resuming from" in capsys.readouterr().out
    assert [r["epoch"] for r in epoch_records(tmp_path / "run")] == [1, 2]


def test_files_get_the_umask_s_mode_without_the_umask_being_touched(tmp_path, monkeypatch):
    """Checkpoints are written in a thread beside others that create files: reading the mode must not
    set the process-wide umask, even for a moment (os.umask is made to fail here)."""
    import os
    import stat

    from hvdtrain.io.atomic import atomic_write

    umask = os.umask(0o027)
    try:
        def touched(mask):
            raise AssertionError("the umask was set")

        monkeypatch.setattr(os, "umask", touched)
        atomic_write(tmp_path / "state.pt", lambda handle: handle.write(b"x"))
        assert stat.S_IMODE((tmp_path / "state.pt").stat().st_mode) == 0o640
    finally:
        monkeypatch.undo()
        os.umask(umask)

"""Crashes a checkpoint save at each of its file-system steps in turn: the victim of the crash-safety test.

    python tests/workers/checkpoint_writer.py ROOT

One save is a sequence of steps (the checkpoint's bytes, half of them first, fsync, rename,
the manifest the same way, the links, deleting old files). For each step n, a child forked
from this process (torch already imported) saves epochs 1-3 into ROOT/n and kills itself
with SIGKILL just before step n of epoch 4's save. Prints the number of steps of one save.
"""

import io
import os
import signal
import sys
from pathlib import Path

import torch

from hvdtrain.io.checkpoint import CheckpointStore

root = Path(sys.argv[1])
PATCHED = ("fsync", "replace", "link", "chmod", "unlink", "rename")


def save_epochs(run_dir: Path, kill_at: int | None) -> int:
    """Saves epochs 1-4; during epoch 4's save, dies before step `kill_at`. Returns its steps."""
    steps = 0
    armed = False

    def step() -> None:
        nonlocal steps
        if armed:
            steps += 1
            if steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def counted(function):
        def wrapper(*args, **kwargs):
            step()
            return function(*args, **kwargs)
        return wrapper

    for name in PATCHED:
        setattr(os, name, counted(getattr(os, name)))
    real_save = torch.save

    def save_in_two_halves(state, handle):  # a kill between them leaves a torn file
        buffer = io.BytesIO()
        real_save(state, buffer)
        data = buffer.getvalue()
        step()
        handle.write(data[:len(data) // 2])
        step()
        handle.write(data[len(data) // 2:])

    torch.save = save_in_two_halves
    store = CheckpointStore(run_dir, keep_last=2)
    for epoch in range(1, 5):
        armed = epoch == 4
        weights = torch.full((250_000,), float(epoch))
        store.save({"model": {"w": weights}, "optimizer": {}, "epoch": epoch, "step": 10 * epoch}, epoch,
                   {"val_acc": 0.5, "val_loss": 1.0})
    return steps


def in_child(run_dir: Path, kill_at: int | None) -> int:
    """Runs `save_epochs` in a forked child; its exit status (or -signal)."""
    pid = os.fork()
    if pid == 0:
        steps = save_epochs(run_dir, kill_at)
        (run_dir / "steps").write_text(str(steps))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


assert in_child(root / "whole", None) == 0
total = int((root / "whole" / "steps").read_text())
for n in range(1, total + 1):
    status = in_child(root / str(n), n)
    assert status == -signal.SIGKILL, f"the save should have been killed at step {n}, exited {status}"
print(total, flush=True)

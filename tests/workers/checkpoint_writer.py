"""Writes checkpoints in a loop until killed: the victim of the crash-safety test.

    python tests/workers/checkpoint_writer.py RUN_DIR FIRST_EPOCH
"""

import sys
from pathlib import Path

import torch

from hvdtrain.io.checkpoint import CheckpointStore

run_dir, epoch = Path(sys.argv[1]), int(sys.argv[2])
store = CheckpointStore(run_dir, keep_last=2)
weights = torch.randn(4_000_000)  # 16 MB: a write takes long enough to be interrupted
print("ready", flush=True)
while True:
    weights += 1
    store.save({"model": {"w": weights}, "optimizer": {}, "epoch": epoch, "step": epoch * 10}, epoch,
               {"val_acc": 0.5, "val_loss": 1.0})
    epoch += 1

"""A sweep in one job that goes wrong between two fits (hvdtrain's Python API).

    mpirun -np 2 python tests/workers/api_sweep.py RUN_DIR raise-between
    torchrun --nproc-per-node 2 tests/workers/api_sweep.py RUN_DIR after-a-failed-fit
    horovodrun --gloo -np 2 python tests/workers/api_sweep.py RUN_DIR uncaught
    torchrun --nproc-per-node 2 tests/workers/api_sweep.py RUN_DIR bad-input

raise-between: after the first fit, rank 0's script raises (its results could not be written)
while rank 1 goes on to the second fit, which waits for rank 0: the job must end, not hang.
after-a-failed-fit: the first fit fails on every rank (a loss that is not a scalar), the script
catches it and fits again: one line says why that cannot run in this process.
uncaught: rank 1's callback raises in the first epoch's end, and no rank catches what fit raises.
bad-input: rank 1's data factory fails (its files missing), not caught.
"""

import sys

import torch

import hvdtrain
from user_code import _rank, blobs_split, per_sample_loss, tiny_net

run_dir, mode = sys.argv[1], sys.argv[2]
rank = _rank()
settings = dict(data=blobs_split(), epochs=1, batch_size=16, progress="off")
if mode == "raise-between":
    hvdtrain.fit(model=tiny_net((5,), 3), task=torch.nn.CrossEntropyLoss(), run_dir=f"{run_dir}/a", **settings)
    if rank == 0:
        raise PermissionError("results.csv is not writable")
    hvdtrain.fit(model=tiny_net((5,), 3), task=torch.nn.CrossEntropyLoss(), run_dir=f"{run_dir}/b", **settings)
elif mode == "bad-input":
    hvdtrain.fit(model=tiny_net((5,), 3), task=torch.nn.CrossEntropyLoss(), run_dir=f"{run_dir}/a",
                 **{**settings, "data": "user_code:missing_on_rank_one"})
elif mode == "uncaught":
    class FailsOnRank1:
        def on_epoch_end(self, state):
            if state.rank == 1:
                raise RuntimeError("the callback of rank 1 broke")

    hvdtrain.fit(model=tiny_net((5,), 3), task=torch.nn.CrossEntropyLoss(), run_dir=f"{run_dir}/a",
                 callbacks=[FailsOnRank1()], **{**settings, "epochs": 2})
else:
    try:
        hvdtrain.fit(model=tiny_net((5,), 3), task=per_sample_loss, run_dir=f"{run_dir}/a", **settings)
    except hvdtrain.UserError as failed:
        print(f"rank {rank} first fit failed: {str(failed)[:60]}", flush=True)
    try:
        hvdtrain.fit(model=tiny_net((5,), 3), task=torch.nn.CrossEntropyLoss(), run_dir=f"{run_dir}/b", **settings)
    except hvdtrain.UserError as refused:
        print(f"rank {rank} second fit refused: {refused}", flush=True)

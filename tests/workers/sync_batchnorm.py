"""Run under a launcher: SyncBatchNorm against one process's BatchNorm over the global batch.

    horovodrun --gloo -np 2 python tests/workers/sync_batchnorm.py
    torchrun --nproc-per-node 2 tests/workers/sync_batchnorm.py

Each rank takes its own slice of one global batch (the slices differ in mean and scale), runs a
conv net with its BatchNorm synchronized, forward and backward; every rank also runs the plain net
over the whole global batch. Outputs, input gradients, running statistics and the weight gradients
summed over ranks must equal the plain net's (1e-5); each rank prints what it found.
"""

import copy

import torch
from torch import nn

from hvdtrain.engine import start_engine
from hvdtrain.train.sync_batchnorm import synchronize_batchnorm

engine = start_engine(threads=1)
rank, size, per_rank = engine.rank, engine.size, 6
torch.manual_seed(0)
global_x = torch.cat([torch.randn(per_rank, 3, 5, 5) * (1 + r) + 3 * r for r in range(size)])  # unlike slices
plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 2))
synced = copy.deepcopy(plain)
assert synchronize_batchnorm(synced, engine) == 1

mine = global_x[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
output = synced(mine)
(output ** 2).sum().backward()
everything = global_x.clone().requires_grad_()
expected = plain(everything)
(expected ** 2).sum().backward()
share = slice(rank * per_rank, (rank + 1) * per_rank)

out_diff = (output - expected[share]).abs().max()
grad_diff = (mine.grad - everything.grad[share]).abs().max()
stats_diff = max((synced[1].running_mean - plain[1].running_mean).abs().max(),
                 (synced[1].running_var - plain[1].running_var).abs().max())
summed = {name: engine.allreduce_sum(p.grad, f"grad.{name}") for name, p in synced.named_parameters()}
weight_diff = max((summed[name] - p.grad).abs().max() for name, p in plain.named_parameters())
local_mean_gap = (mine.mean() - global_x.mean()).abs()
print(f"rank {rank}: output {out_diff:.2e} input grad {grad_diff:.2e} running stats {stats_diff:.2e} "
      f"weight grads {weight_diff:.2e} (this rank's mean is {local_mean_gap:.2f} from the global one)", flush=True)
engine.shutdown(True)

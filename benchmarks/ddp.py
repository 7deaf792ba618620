"""A torchrun + DistributedDataParallel (Gloo) script, the usual alternative (for comparison).

    torchrun --nproc-per-node 2 benchmarks/ddp.py EPOCHS JOB
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.jobs import BATCH, build, timed_epochs

epochs, job = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_num_threads(1)
model, train = build(job)
sampler = DistributedSampler(train, num_replicas=size, rank=rank)
loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
model = DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)

rate = timed_epochs(model, optimizer, loader, epochs, len(loader) * BATCH * size, sampler)
if rank == 0:
    print(json.dumps({"samples_per_s": rate}), flush=True)
# Teardown in order: both ranks done, then DDP's reducer (it holds the process group) freed,
# so the group is destroyed here and not during interpreter exit, where Gloo can abort a rank.
dist.barrier()
del model, optimizer
dist.destroy_process_group()

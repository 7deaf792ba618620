"""A torchrun + DistributedDataParallel (Gloo) script, the usual alternative (for comparison).

    torchrun --nproc-per-node 2 benchmarks/ddp.py EPOCHS
"""

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.jobs import BATCH, small_cnn, synthetic

epochs = int(sys.argv[1])
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_num_threads(1)
train, _ = synthetic()
sampler = DistributedSampler(train, num_replicas=size, rank=rank)
loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
model = DistributedDataParallel(small_cnn())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)

timed_samples, timed_seconds = 0, 0.0
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    model.train()
    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    if epoch > 0:
        timed_samples += len(loader) * BATCH * size
        timed_seconds += seconds
if rank == 0:
    print(json.dumps({"samples_per_s": timed_samples / timed_seconds}))
dist.destroy_process_group()

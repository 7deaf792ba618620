"""A hand-written Horovod loop in the style of Horovod's PyTorch examples (for comparison).

    horovodrun -np 2 python benchmarks/horovod_loop.py EPOCHS
"""

import json
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.jobs import BATCH, small_cnn, synthetic

epochs = int(sys.argv[1])
hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
train, _ = synthetic()
sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
model = small_cnn()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

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
    if epoch > 0:  # epoch 0 warms up
        timed_samples += len(loader) * BATCH * hvd.size()
        timed_seconds += seconds
if hvd.rank() == 0:
    print(json.dumps({"samples_per_s": timed_samples / timed_seconds}))

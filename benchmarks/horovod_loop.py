"""A hand-written Horovod loop in the style of Horovod's PyTorch examples (for comparison).

    horovodrun -np 2 python benchmarks/horovod_loop.py EPOCHS JOB
"""

import json
import sys

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.jobs import BATCH, build, timed_epochs

epochs, job = int(sys.argv[1]), sys.argv[2]
hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model, train = build(job)
sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

rate = timed_epochs(model, optimizer, loader, epochs, len(loader) * BATCH * hvd.size(), sampler)
if hvd.rank() == 0:
    print(json.dumps({"samples_per_s": rate}))

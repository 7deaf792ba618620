"""One process, no communication: the plain PyTorch loop (for comparison, and twice at once
with one thread each for the ceiling).

    python benchmarks/single.py EPOCHS JOB [THREADS]     # THREADS: every core by default
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader

from benchmarks.jobs import BATCH, build, timed_epochs

epochs, job = int(sys.argv[1]), sys.argv[2]
threads = int(sys.argv[3]) if len(sys.argv) > 3 else len(os.sched_getaffinity(0))
torch.manual_seed(0)
torch.set_num_threads(threads)
model, train = build(job)
loader = DataLoader(train, batch_size=BATCH, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

rate = timed_epochs(model, optimizer, loader, epochs, len(loader) * BATCH)
print(json.dumps({"samples_per_s": rate, "threads": torch.get_num_threads()}))

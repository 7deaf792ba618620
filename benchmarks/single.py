"""One process using every core: the plain PyTorch loop (for comparison).

    python benchmarks/single.py EPOCHS
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from benchmarks.jobs import BATCH, small_cnn, synthetic

epochs = int(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(len(os.sched_getaffinity(0)))
train, _ = synthetic()
loader = DataLoader(train, batch_size=BATCH, shuffle=True)
model = small_cnn()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

timed_samples, timed_seconds = 0, 0.0
for epoch in range(epochs):
    model.train()
    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    if epoch > 0:
        timed_samples += len(loader.dataset) // BATCH * BATCH
        timed_seconds += seconds
print(json.dumps({"samples_per_s": timed_samples / timed_seconds, "threads": torch.get_num_threads()}))

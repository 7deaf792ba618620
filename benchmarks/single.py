"""One process using every core: the plain PyTorch loop (for comparison).

    python benchmarks/single.py EPOCHS
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader

from benchmarks.jobs import BATCH, small_cnn, synthetic, timed_epochs

epochs = int(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(len(os.sched_getaffinity(0)))
train, _ = synthetic()
loader = DataLoader(train, batch_size=BATCH, shuffle=True)
model = small_cnn()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

rate = timed_epochs(model, optimizer, loader, epochs, len(loader) * BATCH)
print(json.dumps({"samples_per_s": rate, "threads": torch.get_num_threads()}))

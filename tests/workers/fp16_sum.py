"""Run under a launcher: gradients of 40000 on every rank, averaged with fp16 on the wire.

    horovodrun --gloo -np 2 python tests/workers/fp16_sum.py
    torchrun --nproc-per-node 2 tests/workers/fp16_sum.py

Each is below fp16's limit (65504); their sum over 2 ranks is not. Prints each rank's averaged gradient.
"""

import torch

from hvdtrain.engine import GradientSync, start_engine

engine = start_engine("auto", "cpu", threads=1)
model = torch.nn.Linear(4, 1, bias=False)
optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, GradientSync(compression="fp16"))
(model.weight.sum() * 40000.0).backward()
engine.synchronize(optimizer)
print(f"rank {engine.rank} averaged gradient {model.weight.grad.tolist()}", flush=True)
engine.shutdown(finished=True)

"""Run under a launcher: k steps on rank-specific data, then each rank saves its parameters.

    horovodrun --gloo -np 2 python tests/workers/ranks_agree.py OUT_DIR STEPS [average|adasum]
    torchrun --nproc-per-node 2 tests/workers/ranks_agree.py OUT_DIR STEPS
"""

import sys
from pathlib import Path

import torch

from hvdtrain.engine import GradientSync, start_engine
from hvdtrain.train.loop import apply_gradients
from hvdtrain.models import mlp

out, steps = Path(sys.argv[1]), int(sys.argv[2])
adasum = sys.argv[3:] == ["adasum"]
engine = start_engine("auto", "cpu", threads=1)
torch.manual_seed(100 + engine.rank)  # deliberately different initial weights on each rank
model = mlp((6,), 3, hidden=8)
initial = {k: v.clone() for k, v in model.state_dict().items()}
optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                   GradientSync(adasum=adasum))
engine.broadcast_parameters(model)
broadcast = {k: v.clone() for k, v in model.state_dict().items()}
generator = torch.Generator().manual_seed(engine.rank)  # different data on each rank
for _ in range(steps):
    x, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    apply_gradients(model, optimizer, engine, clip_grad_norm=None)
torch.save({"initial": initial, "broadcast": broadcast, "final": model.state_dict(), "size": engine.size},
           out / f"rank{engine.rank}.pt")
engine.shutdown()

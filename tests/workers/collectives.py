"""Run under a launcher: the engine's collectives on their own, several checks in one launch.

    horovodrun --gloo -np 2 python tests/workers/collectives.py OUT_DIR [adasum]
    torchrun --nproc-per-node 2 tests/workers/collectives.py OUT_DIR

- 5 steps on rank-specific data from rank-specific initial weights (a channels-last convolution among
  them), averaged (and, given `adasum`,
  once more combined with Adasum): each rank saves its parameters before and after the broadcast
  and at the end, to OUT_DIR/rank{R}-{combine}.pt.
- Each rank gathers its own object to rank 0 and prints what it got.
- Gradients of 40001 on every rank averaged with fp16 on the wire: each is below fp16's limit
  (65504), their sum over 2 ranks is not, and fp16 holds 40001 as 40000 (its steps are 32 there),
  so 40000 comes back only through fp16. Prints each rank's averaged gradient.
- A module with extra state in its state dict (get_extra_state: any object, here the rank that built
  it) is broadcast: each rank prints the extra state it then holds.
- Rank 1 comes to a gradient sync WAIT_SECONDS late: rank 0 prints how long it waited there and the
  CPU time its waiting thread used meanwhile.
"""

import sys
import time
from pathlib import Path

import torch

from hvdtrain.engine import GradientSync, start_engine
from hvdtrain.train.loop import apply_gradients

STEPS = 5
WAIT_SECONDS = 2.0


def ranks_agree(combine: str) -> None:
    torch.manual_seed(100 + engine.rank)  # deliberately different initial weights on each rank
    model = channels_last_net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                       GradientSync(adasum=combine == "adasum"))
    engine.broadcast_parameters(model)
    broadcast = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(engine.rank)  # different data on each rank
    for _ in range(STEPS):
        x, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        apply_gradients(model, optimizer, engine, clip_grad_norm=None)
    torch.save({"initial": initial, "broadcast": broadcast, "final": model.state_dict(), "size": engine.size},
               out / f"rank{engine.rank}-{combine}.pt")


def channels_last_net() -> torch.nn.Module:
    """6 inputs, 3 classes, through a convolution whose weight is channels-last and so not contiguous:
    Horovod's collectives refuse such a tensor unless the engine sends a contiguous copy."""
    net = torch.nn.Sequential(torch.nn.Unflatten(1, (2, 3, 1)), torch.nn.Conv2d(2, 4, (2, 1)), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(8, 3)).to(memory_format=torch.channels_last)
    assert not net[1].weight.is_contiguous()
    return net


def gather() -> None:
    got = engine.gather_object({"rank": engine.rank, "payload": list(range(engine.rank * 3))}, "test")
    print(f"rank {engine.rank} got {got}", flush=True)


def fp16_sum() -> None:
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                      GradientSync(compression="fp16"))
    (model.weight.sum() * 40001.0).backward()
    engine.synchronize(optimizer)
    print(f"rank {engine.rank} averaged gradient {model.weight.grad.tolist()}", flush=True)


class WithExtraState(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 2)
        self.built_on = {"rank": engine.rank}

    def get_extra_state(self) -> dict:
        return self.built_on

    def set_extra_state(self, state: dict) -> None:
        self.built_on = state


def extra_state() -> None:
    model = torch.nn.Sequential(WithExtraState())
    engine.broadcast_parameters(model)
    print(f"rank {engine.rank} holds extra state {model[0].built_on}", flush=True)


def waiting() -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, GradientSync())
    model.weight.sum().backward()
    if engine.rank == 1:
        time.sleep(WAIT_SECONDS)
    wall, cpu = time.perf_counter(), time.thread_time()
    engine.synchronize(optimizer)
    if engine.rank == 0:
        print(f"rank 0 waited {time.perf_counter() - wall:.2f} s using {time.thread_time() - cpu:.3f} s of CPU",
              flush=True)


out = Path(sys.argv[1])
engine = start_engine("auto", "cpu", threads=1)
for combine in ["average", *sys.argv[2:]]:
    ranks_agree(combine)
gather()
fp16_sum()
extra_state()
waiting()
engine.shutdown(finished=True)

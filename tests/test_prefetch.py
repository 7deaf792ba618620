"""Loading the next batch while the step computes (hvdtrain.data.prefetch): the same batches in the
same order, the same weights, and loading ahead only where it draws nothing the training draws."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvdtrain.config import TaskConfig
from hvdtrain.data import prefetch
from hvdtrain.data.loading import batches
from hvdtrain.data.prefetch import DeviceBatches, loads_apart_from_training
from hvdtrain.data.sampler import ShardedBatchSampler
from hvdtrain.engine import LocalEngine
from hvdtrain.tasks import build_task
from hvdtrain.train import loop
from hvdtrain.train.loop import Training, train_epoch

CPU = torch.device("cpu")


def _tensor_batches(n=40, batch=8, pin=False):
    data = TensorDataset(torch.randn(n, 4, generator=torch.Generator().manual_seed(1)), torch.arange(n) % 3)
    sampler = ShardedBatchSampler(n, batch, 0, 1, seed=3)
    sampler.begin_epoch(0)
    return batches(data, sampler, 0, pin)


class _Counted:
    """An iterable that counts how many items its iterator has handed out."""

    def __init__(self, items):
        self.items, self.taken = items, 0

    def __iter__(self):
        for item in self.items:
            self.taken += 1
            yield item


@pytest.mark.parametrize("ahead", [True, False])
def test_stage_loads_the_next_batch_early_only_when_ahead(ahead):
    source = _Counted([torch.tensor([i]) for i in range(3)])
    on_device = DeviceBatches(source, CPU, channels_last=False, ahead=ahead)
    seen = []
    for loaded, batch in on_device:
        seen.append(int(batch))
        taken = source.taken
        on_device.stage()
        on_device.stage()  # a second call loads nothing more
        assert source.taken == (min(taken + 1, 3) if ahead else taken)
        assert torch.equal(loaded, batch)
    assert seen == [0, 1, 2]
    assert [int(b) for _, b in on_device] == [0, 1, 2]  # again, for the next epoch


def test_only_loading_that_draws_nothing_from_the_training_is_done_ahead():
    data = TensorDataset(torch.zeros(8, 2))
    assert loads_apart_from_training(_tensor_batches())
    assert loads_apart_from_training(DataLoader(data, batch_size=4, num_workers=1))
    assert not loads_apart_from_training(DataLoader(data, batch_size=4))  # in this process: it may draw
    assert not loads_apart_from_training([torch.zeros(2)])
    assert not DeviceBatches(_tensor_batches(), CPU, channels_last=False).ahead  # a CPU: nothing to overlap


def _trained(monkeypatch, ahead):
    monkeypatch.setattr(loop, "DeviceBatches", lambda *args, **kwargs: prefetch.DeviceBatches(*args, **kwargs, ahead=ahead))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 3))  # dropout: draws each step
    training = Training(model, torch.optim.SGD(model.parameters(), lr=0.1), build_task(TaskConfig()),
                        learning_rate=lambda step: 0.1, accumulate=2)
    result, step = train_epoch(training, LocalEngine(CPU), _tensor_batches(), first_step=0)
    return result, step, [p.detach().clone() for p in model.parameters()]


def test_loading_ahead_leaves_the_weights_bit_identical(monkeypatch):
    (result, step, weights), (result_ahead, step_ahead, weights_ahead) = (
        _trained(monkeypatch, ahead) for ahead in (False, True))
    assert (result, step) == (result_ahead, step_ahead) and step == 2
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_ahead))


@pytest.mark.gpu
def test_in_memory_batches_are_gathered_into_pinned_memory():
    plain, pinned = list(_tensor_batches()), list(_tensor_batches(pin=True))
    assert all(t.is_pinned() for batch in pinned for t in batch)
    assert all(torch.equal(a, b) for x, y in zip(plain, pinned) for a, b in zip(x, y))
    on_device = DeviceBatches(_tensor_batches(pin=True), torch.device("cuda"), channels_last=False)
    assert on_device.ahead
    assert all(torch.equal(batch[0].cpu(), x[0]) for (_, batch), x in zip(on_device, plain))

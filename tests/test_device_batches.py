"""Loading the next batch while the step computes (hvdtrain.train.device_batches): the same batches in the
same order, the same weights, and loading ahead only where it draws nothing the training draws."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvdtrain.config import TaskConfig
from hvdtrain.train import device_batches
from hvdtrain.data.loading import batches
from hvdtrain.train.device_batches import DeviceBatches, loads_apart_from_training
from hvdtrain.data.sampler import ShardedBatchSampler
from hvdtrain.engine import LocalEngine
from hvdtrain.tasks import build_task
from hvdtrain.train import loop
from hvdtrain.train.loop import Training, train_epoch

CPU = torch.device("cpu")


def _tensor_batches(n=48, batch=8, pin=False):
    data = TensorDataset(torch.randn(n, 4, generator=torch.Generator().manual_seed(1)), torch.arange(n) % 3)
    sampler = ShardedBatchSampler(n, batch, 0, 1, seed=3, multiple=2)
    sampler.begin_epoch(0)
    return batches(data, sampler, 0, pin)


class _Noisy(torch.utils.data.Dataset):
    """Samples that draw from the training process's random state as they load (a random augmentation)."""

    def __len__(self):
        return 48

    def __getitem__(self, index):
        return torch.randn(4) * 0.1 + index / 48, index % 3


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


def _trained(monkeypatch, ahead, loaded=_tensor_batches):
    """(epoch result, next step, weights, the random state at each step's end: what a checkpoint keeps)."""
    monkeypatch.setattr(loop, "DeviceBatches", lambda *args, **kwargs: device_batches.DeviceBatches(*args, **kwargs, ahead=ahead))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 3))  # dropout: draws each step
    training = Training(model, torch.optim.SGD(model.parameters(), lr=0.1), build_task(TaskConfig()),
                        learning_rate=lambda step: 0.1, accumulate=2)
    states = []
    result, step = train_epoch(training, LocalEngine(CPU), loaded(), first_step=0,
                               on_step=lambda step, loss: states.append(torch.get_rng_state()))
    return result, step, [p.detach().clone() for p in model.parameters()], states


def _same(tensors, others):
    return len(tensors) == len(others) and all(torch.equal(a, b) for a, b in zip(tensors, others))


def test_loading_ahead_leaves_the_weights_and_the_checkpointed_random_state_bit_identical(monkeypatch):
    (result, step, weights, states), (result_ahead, step_ahead, weights_ahead, states_ahead) = (
        _trained(monkeypatch, ahead) for ahead in (False, True))
    assert (result, step) == (result_ahead, step_ahead) and step == 3
    assert _same(weights, weights_ahead) and _same(states, states_ahead)


def test_loading_that_draws_from_the_training_s_random_state_is_not_done_ahead(monkeypatch):
    def noisy():
        return DataLoader(_Noisy(), batch_size=8)

    assert not DeviceBatches(noisy(), torch.device("cuda"), channels_last=False).ahead
    # Why: ahead, a checkpoint at step k would keep the random state after batch k+1's draws, and a
    # resume would draw batch k+1 anew from there.
    _, _, _, states = _trained(monkeypatch, False, noisy)
    _, _, _, states_ahead = _trained(monkeypatch, True, noisy)
    assert not _same(states, states_ahead)


def test_the_phases_are_the_same_whether_a_batch_was_loaded_ahead_or_not():
    for ahead in (False, True):
        phases = []

        def doing(phase):
            left = phases[-1] if phases else ""
            phases.append(phase)
            return left

        on_device = DeviceBatches([torch.zeros(1), torch.ones(1)], CPU, channels_last=False, doing=doing, ahead=ahead)
        for _ in on_device:
            doing("forward")
            doing("backward")
            on_device.stage()
            doing("the optimizer step")
        compact = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
        step = ["batch to device", "forward", "backward"]
        if ahead:  # the next batch's wait and copy inside backward, which then goes on
            assert compact == ["data loading", *step, "data loading", "batch to device", "backward",
                               "the optimizer step", *step, "data loading", "backward", "the optimizer step",
                               "data loading"]
        else:
            assert compact == ["data loading", *step, "the optimizer step", "data loading", *step,
                               "the optimizer step", "data loading"]


def test_a_batch_that_fails_to_load_ahead_fails_when_the_loop_asks_for_it():
    def source():
        yield torch.zeros(1)
        raise OSError("corrupt record 7")

    on_device = DeviceBatches(source(), CPU, channels_last=False, ahead=True)
    iterator = iter(on_device)
    next(iterator)
    on_device.stage()  # the step in flight ends as it would have
    with pytest.raises(OSError, match="corrupt record 7"):
        next(iterator)


@pytest.mark.gpu
def test_in_memory_batches_are_gathered_into_pinned_memory():
    plain, pinned = list(_tensor_batches()), list(_tensor_batches(pin=True))
    assert all(t.is_pinned() for batch in pinned for t in batch)
    assert all(torch.equal(a, b) for x, y in zip(plain, pinned) for a, b in zip(x, y))
    on_device = DeviceBatches(_tensor_batches(pin=True), torch.device("cuda"), channels_last=False)
    assert on_device.ahead
    seen = []
    for _, batch in on_device:
        work = batch[0] @ torch.ones(4, 4096, device="cuda")  # the GPU busy while the next batch loads
        on_device.stage()
        seen.append((batch[0] + 0 * work[:, :4]).cpu())
    assert len(seen) == len(plain) and all(torch.equal(a, x[0]) for a, x in zip(seen, plain))
    cuda_resident = TensorDataset(torch.randn(16, 4, device="cuda"), torch.zeros(16, dtype=torch.long, device="cuda"))
    sampler = ShardedBatchSampler(16, 8, 0, 1)
    sampler.begin_epoch(0)
    assert all(t.is_cuda for batch in batches(cuda_resident, sampler, 0, True) for t in batch)  # gathered where it is

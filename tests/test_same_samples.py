"""Every rank must make the same samples: what the check says of each way a rank's differ from rank 0's,
and what it lets pass, on two ranks in threads whose collectives meet at a barrier (under real launchers:
tests/test_multiprocess.py, bad input)."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from hvdtrain import same_samples
from hvdtrain.same_samples import check_same_samples
from hvdtrain.engine.local import LocalEngine
from hvdtrain.errors import UserError

X = torch.arange(120, dtype=torch.float32).reshape(40, 3) / 7
Y = torch.arange(40) % 4


class _Exchange:
    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list = [None, None]


class _Rank(LocalEngine):
    """One of two ranks in threads of this process: an allgather meets the other rank's at a barrier."""

    def __init__(self, exchange: _Exchange, rank: int):
        super().__init__(torch.device("cpu"))
        self.rank, self.size, self.exchange = rank, 2, exchange
        self.gathered: list[str] = []

    def allgather_object(self, obj, name):
        self.gathered.append(name)
        self.exchange.slots[self.rank] = obj
        self.exchange.barrier.wait()
        everyone = list(self.exchange.slots)
        self.exchange.barrier.wait()
        return everyone

    def broadcast_object(self, obj, name):
        return self.allgather_object(obj, name)[0]


def _checked_on_two_ranks(parts_of, monkeypatch) -> tuple[list, list]:
    """check_same_samples on ranks 0 and 1 at once, rank r's parts `parts_of(r)`: (each rank's error or
    None, each rank's collectives). Their reads take turns: both ranks' generators are this process's."""
    read, turn = same_samples._read, threading.Lock()

    def in_turn(dataset):
        with turn:
            return read(dataset)

    monkeypatch.setattr(same_samples, "_read", in_turn)
    exchange, errors = _Exchange(), [None, None]
    engines = [_Rank(exchange, rank) for rank in (0, 1)]

    def run(rank):
        try:
            check_same_samples(parts_of(rank), engines[rank])
        except Exception as err:  # noqa: BLE001 - what the rank would say
            errors[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return errors, [engine.gathered for engine in engines]


def _refused_alike(errors) -> str:
    assert all(isinstance(err, UserError) for err in errors), errors
    assert str(errors[0]) == str(errors[1])  # every rank raises the same line (rank 0's is said)
    return str(errors[0])


def test_alike_samples_pass_in_one_small_collective(monkeypatch):
    errors, gathered = _checked_on_two_ranks(lambda rank: {"train": TensorDataset(X, Y), "val": TensorDataset(X, Y)},
                                             monkeypatch)
    assert errors == [None, None] and gathered == [["same_samples"]] * 2


def test_classes_numbered_otherwise_on_a_rank_are_named_with_the_sample_and_both_labels(monkeypatch):
    """As `list(set(names))` numbers them: Python hashes strings otherwise in each process."""
    parts = lambda rank: {"train": TensorDataset(X, (Y + rank) % 4), "val": TensorDataset(X, Y)}
    said = _refused_alike(_checked_on_two_ranks(parts, monkeypatch)[0])
    assert said.startswith("rank 1 made other samples than rank 0: train sample 0 differs at [1]: 1 there, 0 on "
                           "rank 0: every rank must make the same data set, in the same order"), said
    assert said.endswith("do not shard it in your factory")


def test_a_split_of_a_rank_s_own_is_named_in_the_inputs(monkeypatch):
    def parts(rank):
        order = torch.randperm(40, generator=torch.Generator().manual_seed(rank))
        return {"train": TensorDataset(X[order[:30]], Y[order[:30]]), "val": TensorDataset(X[order[30:]], Y[order[30:]])}

    said = _refused_alike(_checked_on_two_ranks(parts, monkeypatch)[0])
    assert said.startswith("rank 1 made other samples than rank 0: train sample 0 differs at [0]: float32 of shape "
                           "(3,) unlike rank 0's in 3 of 3 values"), said


class _Augmented(Dataset):
    """Noise added on each read: from torch's generator (as torchvision's transforms draw), or from one of
    its own seeded from the operating system."""

    def __init__(self, own_generator: bool):
        self.generator = np.random.default_rng() if own_generator else None

    def __len__(self):
        return len(X)

    def __getitem__(self, index):
        noise = torch.from_numpy(self.generator.random(3)).float() if self.generator else torch.rand(3)
        return X[index] + noise, Y[index]


@pytest.mark.parametrize("own_generator", [False, True])
def test_random_augmentation_passes_whichever_generator_it_draws_from(own_generator, monkeypatch):
    """torch's: read with the generators seeded alike, the same on both ranks. A generator of its own: a
    sample reads otherwise each time, and nothing can be compared."""
    errors, gathered = _checked_on_two_ranks(lambda rank: {"train": _Augmented(own_generator)}, monkeypatch)
    assert errors == [None, None]
    assert gathered[0] == (["same_samples", "same_samples.steady"] if own_generator else ["same_samples"])


@pytest.mark.parametrize("steady_rank", [0, 1])
def test_samples_one_rank_reads_otherwise_each_time_are_not_compared_with_another_s(steady_rank, monkeypatch):
    """One rank's data set draws from a generator of its own, the other's does not: neither can be held
    to the other's."""
    parts = lambda rank: {"train": TensorDataset(X, Y) if rank == steady_rank else _Augmented(own_generator=True)}
    errors, _ = _checked_on_two_ranks(parts, monkeypatch)
    assert errors == [None, None]


def test_floats_another_host_rounds_otherwise_pass(monkeypatch):
    errors, _ = _checked_on_two_ranks(lambda rank: {"train": TensorDataset(X * (1 + rank * 1e-7), Y)}, monkeypatch)
    assert errors == [None, None]


class _Unreadable(TensorDataset):
    def __init__(self, on_rank: int | None, rank: int):
        super().__init__(X, Y)
        self.broken = on_rank == rank

    def __getitem__(self, index):
        if self.broken and index == len(X) - 1:
            raise OSError(f"/data/{index}.jpg: unexpected end of file")
        return super().__getitem__(index)


@pytest.mark.parametrize("on_rank", [0, 1])
def test_a_sample_only_one_rank_cannot_read_names_that_rank_and_its_error(on_rank, monkeypatch):
    said = _refused_alike(_checked_on_two_ranks(lambda rank: {"val": _Unreadable(on_rank, rank)}, monkeypatch)[0])
    assert said == (f"rank {on_rank} could not read val sample 39 (rank {1 - on_rank} could): OSError: "
                    "/data/39.jpg: unexpected end of file")


def test_a_sample_no_rank_can_read_is_left_to_training(monkeypatch):
    """Every rank alike: training meets it, and names it where it does."""
    class Broken(TensorDataset):
        def __getitem__(self, index):
            raise OSError("no such file")

    errors, _ = _checked_on_two_ranks(lambda rank: {"train": Broken(X, Y)}, monkeypatch)
    assert errors == [None, None]


def test_a_part_whose_samples_read_otherwise_each_time_leaves_the_other_part_checked(monkeypatch):
    """Augmented training samples (a generator of the data set's own) cannot be compared; the validation
    part still is."""
    parts = lambda rank: {"train": _Augmented(own_generator=True), "val": TensorDataset(X, (Y + rank) % 4)}
    said = _refused_alike(_checked_on_two_ranks(parts, monkeypatch)[0])
    assert said.startswith("rank 1 made other samples than rank 0: val sample 0 differs at [1]: 1 there, 0 on rank 0")


class _CountsItsReads(Dataset):
    """Augmentation from a count of its own reads: sample 0 reads otherwise each time, and the others
    alike, but otherwise on each rank (as a generator of few outcomes may draw them by chance)."""

    def __init__(self, rank: int):
        self.rank, self.reads = rank, 0

    def __len__(self):
        return len(X)

    def __getitem__(self, index):
        self.reads += index == 0
        return X[index] + (self.reads if index == 0 else self.rank), Y[index]


def test_a_part_is_compared_only_where_all_its_samples_read_alike_again(monkeypatch):
    errors, _ = _checked_on_two_ranks(lambda rank: {"train": _CountsItsReads(rank)}, monkeypatch)
    assert errors == [None, None]


class _Sample(Dataset):
    def __init__(self, sample_of_index):
        self.sample_of_index = sample_of_index

    def __len__(self):
        return 40

    def __getitem__(self, index):
        return self.sample_of_index(index)


def _failing(message):
    def raises(index):
        raise OSError(message)
    return raises


@pytest.mark.parametrize("sample_on", [
    # a path on the host's own disk (data.name may differ per host), a sample's id
    lambda rank: lambda index: {"x": X[index], "path": f"/scratch/node{rank}/{index}.jpg", "id": f"{rank}-{index}"},
    # no rank reads it, each naming its own host's file: training meets it and names it
    lambda rank: _failing(f"/scratch/node{rank}/x.bin: unexpected end of file"),
    lambda rank: lambda index: (X[index] * (1 + rank * 1e-7), float("nan")),  # NaN is NaN, beside rounding
    # one bf16 step up (another host rounded its arithmetic otherwise), an image decoded by another libjpeg (one level off)
    lambda rank: lambda index: ((X[index].bfloat16().view(torch.int16) + rank).view(torch.bfloat16), Y[index]),
    lambda rank: lambda index: (torch.full((3, 4, 4), 100 + rank, dtype=torch.uint8), Y[index]),
    # arrays rank 0 cannot compare with this rank's (other fields): not held against it, and no rank waits
    lambda rank: lambda index: np.zeros(2, dtype=[(f"field{rank}", "f4")]),
], ids=["strings", "unread-everywhere", "nan", "bf16-rounding", "decoded-otherwise", "not-comparable"])
def test_what_cannot_be_held_against_rank_0_s_passes(sample_on, monkeypatch):
    errors, _ = _checked_on_two_ranks(lambda rank: {"train": _Sample(sample_on(rank))}, monkeypatch)
    assert errors == [None, None]


def test_an_id_that_changes_on_every_read_hides_no_other_samples(monkeypatch):
    """Text is compared as text whatever it says: a fresh id in each sample neither counts against a rank
    nor makes its samples read otherwise (which would leave them uncompared)."""
    import uuid

    sample_on = lambda rank: lambda index: (X[(index + rank) % len(X)], Y[(index + rank) % len(X)], str(uuid.uuid4()))
    said = _refused_alike(_checked_on_two_ranks(lambda rank: {"train": _Sample(sample_on(rank))}, monkeypatch)[0])
    assert said.startswith("rank 1 made other samples than rank 0: train sample 0 differs at [0]:"), said


def test_token_ids_are_compared_exactly(monkeypatch):
    sample_on = lambda rank: lambda index: torch.tensor([2088 + 3 * rank, 5, 7])
    said = _refused_alike(_checked_on_two_ranks(lambda rank: {"train": _Sample(sample_on(rank))}, monkeypatch)[0])
    assert "train sample 0 differs: int64 of shape (3,) unlike rank 0's in 1 of 3 values" in said, said


class _Unsayable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize("sample_on, said", [
    (lambda rank: lambda index: (X[index], 10**5000), None),  # its decimal text is over Python's limit: it raised
    (lambda rank: _failing("x") if rank == 0 else lambda index: (X[index], Y[index]), "rank 0 could not read train "
     "sample 0 (rank 1 could): OSError: x"),
    (lambda rank: (lambda index: (_ for _ in ()).throw(_Unsayable())) if rank else lambda index: (X[index], Y[index]),
     "rank 1 could not read train sample 0 (rank 0 could): _Unsayable"),
], ids=["huge-int", "unread-on-rank-0", "error-without-text"])
def test_odd_samples_end_alike_on_both_ranks(sample_on, said, monkeypatch):
    errors, gathered = _checked_on_two_ranks(lambda rank: {"train": _Sample(sample_on(rank))}, monkeypatch)
    assert gathered[0] == gathered[1]  # the same collectives: neither rank left the other waiting
    assert (errors == [None, None]) if said is None else _refused_alike(errors) == said


def test_parts_of_other_sizes_are_named_with_each_rank_s_sizes(monkeypatch):
    """evaluate and predict, whose parts are compared here alone (fit compares the sizes first)."""
    said = _refused_alike(_checked_on_two_ranks(lambda rank: {"val": TensorDataset(X[rank:], Y[rank:])},
                                                monkeypatch)[0])
    assert said.startswith("ranks made data sets of different sizes (rank 0: 40 val, rank 1: 39 val): every rank")


def test_a_stream_is_not_read_by_position_even_inside_another_data_set(monkeypatch):
    """A stream's samples by position are read by walking it: its shards are compared instead."""
    from hvdtrain.config import DataConfig
    from hvdtrain.data.sources import build_data

    split = build_data(DataConfig(name="user_code:indexed_stream"), seed=0)
    monkeypatch.setattr(same_samples, "_read", lambda dataset: pytest.fail("a stream was read"))
    parts = {"train": split.train, "val": Subset(split.val, [0, 1]), "all": ConcatDataset([split.train, split.val])}
    errors, gathered = _checked_on_two_ranks(lambda rank: parts, monkeypatch)
    assert errors == [None, None] and gathered == [["same_samples"]] * 2


def test_the_random_states_are_put_back_and_one_process_reads_nothing():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    assert len(same_samples._read(_Augmented(own_generator=False))) == same_samples.PROBES
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]
    check_same_samples({"train": _Sample(lambda index: pytest.fail("one process read a sample"))},
                       LocalEngine(torch.device("cpu")))

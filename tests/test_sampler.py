import numpy as np
import pytest

from hvdtrain.data.sampler import EvalShardSampler, FeistelPermutation, ShardedBatchSampler


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_feistel_is_a_permutation(n):
    values = FeistelPermutation(n, seed=3, epoch=1)(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))


def test_permutation_depends_on_seed_and_epoch_only():
    positions = np.arange(500)
    first = FeistelPermutation(500, seed=1, epoch=0)(positions)
    assert np.array_equal(first, FeistelPermutation(500, seed=1, epoch=0)(positions))
    assert not np.array_equal(first, FeistelPermutation(500, seed=1, epoch=1)(positions))
    assert not np.array_equal(first, FeistelPermutation(500, seed=2, epoch=0)(positions))
    assert not np.array_equal(first, positions)


def _shards(n, batch, world, epoch=0, multiple=1):
    shards = []
    for rank in range(world):
        sampler = ShardedBatchSampler(n, batch, rank, world, seed=5, multiple=multiple)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


@pytest.mark.parametrize("n, batch, world", [(100, 4, 2), (1000, 7, 3), (64, 8, 8), (1797, 64, 2)])
def test_shards_are_disjoint_cover_and_equal_in_length(n, batch, world):
    shards = _shards(n, batch, world)
    lengths = {len(batches) for batches in shards}
    assert len(lengths) == 1  # every rank the same number of batches: no rank waits forever
    flat = [i for batches in shards for b in batches for i in b]
    assert len(flat) == len(set(flat))  # disjoint
    assert len(flat) == n - n % (batch * world)  # covers all but the final partial global batch


def test_global_batches_do_not_depend_on_world_size():
    # Global batch 24: 1 x 24, 2 x 12, 3 x 8, 4 x 6 give the same sets, step by step.
    n = 500
    reference = None
    for world in (1, 2, 3, 4):
        shards = _shards(n, 24 // world, world, epoch=2)
        global_batches = [sorted(i for rank in range(world) for i in shards[rank][step]) for step in range(len(shards[0]))]
        if reference is None:
            reference = global_batches
        assert global_batches == reference


def test_accumulation_rounds_to_whole_steps():
    sampler = ShardedBatchSampler(100, 4, 0, 2, multiple=3)  # 12 batches fit, 12 is a multiple of 3
    assert len(sampler) == 12
    sampler = ShardedBatchSampler(90, 4, 0, 2, multiple=3)  # 11 fit, rounded down to 9
    assert len(sampler) == 9


@pytest.mark.parametrize("n, world", [(10, 3), (360, 2), (5, 8), (1, 2)])
def test_eval_shards_count_every_sample_once(n, world):
    seen = [i for rank in range(world) for batch in EvalShardSampler(n, 4, rank, world) for i in batch]
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("before, after", [(3, 2), (2, 3), (4, 1)])
def test_an_epoch_continued_by_another_world_size_sees_each_sample_once(before, after):
    """Elastic training: some steps with `before` ranks, the rest of the epoch with `after`."""
    n, batch, epoch = 1000, 8, 4
    order = FeistelPermutation(n, seed=5, epoch=epoch)(np.arange(n)).tolist()
    done_steps = 5
    seen = []
    for rank in range(before):
        sampler = ShardedBatchSampler(n, batch, rank, before, seed=5)
        sampler.set_epoch(epoch)
        seen += [i for _, indices in zip(range(done_steps), sampler) for i in indices]
    position = done_steps * batch * before  # what the elastic state commits
    rest = []
    for rank in range(after):
        sampler = ShardedBatchSampler(n, batch, rank, after, seed=5)
        sampler.set_epoch(epoch, start=position)
        rest += [i for indices in sampler for i in indices]
    everything = seen + rest
    assert len(everything) == len(set(everything))  # nothing twice
    # Everything of the epoch's order up to the last whole global batch, nothing else.
    covered = position + (n - position) // (batch * after) * batch * after
    assert sorted(everything) == sorted(order[:covered])


def test_a_start_outside_the_epoch_is_refused():
    sampler = ShardedBatchSampler(10, 2, 0, 1)
    with pytest.raises(ValueError):
        sampler.set_epoch(1, start=11)

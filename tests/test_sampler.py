"""Which samples each rank sees: pure functions of (seed, epoch, rank, world size)."""

from __future__ import annotations

import numpy as np
import pytest

from imagenet_elastic.errors import UserError
from imagenet_elastic.sampler import TrainBatchSampler, epoch_permutation, eval_shard, steps_per_epoch

NUM_SAMPLES = 103  # not a multiple of the global batch: the ragged tail is dropped
GLOBAL_BATCH = 8
SEED = 7


def global_batches(world_size: int, epoch: int, start_step: int = 0, max_steps=None,
                   num_samples: int = NUM_SAMPLES, seed: int = SEED) -> list[list[tuple[int, int]]]:
    """Concatenate every rank's slice of each step into the global batch that step trains on."""
    per_rank = []
    for rank in range(world_size):
        sampler = TrainBatchSampler(num_samples, GLOBAL_BATCH, rank, world_size, seed, max_steps=max_steps)
        sampler.set_epoch(epoch, start_step=start_step)
        per_rank.append(list(sampler))
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1, f"ranks disagree on the number of steps: {steps}"
    return [[key for rank_batches in per_rank for key in rank_batches[step]] for step in range(steps.pop())]


def test_epoch_permutation_is_a_pure_function_of_seed_and_epoch():
    first = epoch_permutation(50, seed=3, epoch=2)
    again = epoch_permutation(50, seed=3, epoch=2)
    np.testing.assert_array_equal(first, again)
    assert sorted(first.tolist()) == list(range(50))


def test_epoch_permutation_differs_across_epochs_and_seeds():
    base = epoch_permutation(50, seed=3, epoch=0)
    assert not np.array_equal(base, epoch_permutation(50, seed=3, epoch=1))
    assert not np.array_equal(base, epoch_permutation(50, seed=4, epoch=0))


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_global_batches_do_not_depend_on_world_size(epoch):
    reference = global_batches(1, epoch)
    assert len(reference) == NUM_SAMPLES // GLOBAL_BATCH
    assert all(len(batch) == GLOBAL_BATCH for batch in reference)
    for world_size in (2, 4):
        assert global_batches(world_size, epoch) == reference, f"world size {world_size}"


def test_global_batches_follow_the_epoch_permutation():
    order = epoch_permutation(NUM_SAMPLES, SEED, 3).tolist()
    batches = global_batches(1, 3)
    assert [index for batch in batches for _, index in batch] == order[:len(batches) * GLOBAL_BATCH]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_epoch_covers_each_sample_at_most_once(world_size):
    batches = global_batches(world_size, epoch=2)
    indices = [index for batch in batches for _, index in batch]
    steps = NUM_SAMPLES // GLOBAL_BATCH
    assert len(indices) == steps * GLOBAL_BATCH
    assert len(set(indices)) == steps * GLOBAL_BATCH
    assert all(0 <= i < NUM_SAMPLES for i in indices)


def test_different_epochs_give_different_batches():
    assert global_batches(1, 0) != global_batches(1, 1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("start_step", [0, 1, 5, 12])
def test_set_epoch_start_step_yields_exactly_the_tail_of_the_epoch(world_size, start_step):
    full = global_batches(world_size, epoch=4)
    tail = global_batches(world_size, epoch=4, start_step=start_step)
    assert tail == full[start_step:]


def test_len_counts_the_remaining_steps():
    sampler = TrainBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, 0, 2, SEED)
    assert len(sampler) == NUM_SAMPLES // GLOBAL_BATCH
    sampler.set_epoch(1, start_step=3)
    assert len(sampler) == NUM_SAMPLES // GLOBAL_BATCH - 3
    assert len(list(sampler)) == len(sampler)


def test_keys_are_epoch_index_tuples_of_python_ints():
    sampler = TrainBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, 1, 2, SEED)
    sampler.set_epoch(6)
    batches = list(sampler)
    assert all(len(batch) == GLOBAL_BATCH // 2 for batch in batches)
    for batch in batches:
        for key in batch:
            assert isinstance(key, tuple) and len(key) == 2
            epoch, index = key
            assert epoch == 6
            assert type(index) is int


def test_max_steps_caps_the_epoch():
    assert steps_per_epoch(NUM_SAMPLES, GLOBAL_BATCH, max_steps=3) == 3
    assert steps_per_epoch(NUM_SAMPLES, GLOBAL_BATCH, max_steps=1000) == NUM_SAMPLES // GLOBAL_BATCH
    capped = global_batches(2, epoch=0, max_steps=3)
    assert capped == global_batches(2, epoch=0)[:3]


def test_global_batch_that_does_not_split_over_ranks_raises_user_error():
    with pytest.raises(UserError, match="does not split evenly over 3 processes"):
        TrainBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, 0, 3, SEED)


def test_dataset_smaller_than_one_global_batch_raises_user_error():
    with pytest.raises(UserError, match="fewer than one global batch") as caught:
        TrainBatchSampler(GLOBAL_BATCH - 1, GLOBAL_BATCH, 0, 1, SEED)
    assert "--batch-size" in str(caught.value)


@pytest.mark.parametrize("num_samples", [1, 7, 10, 11, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_shard_covers_every_index_exactly_once(num_samples, world_size):
    shards = [list(eval_shard(num_samples, rank, world_size)) for rank in range(world_size)]
    combined = [i for shard in shards for i in shard]
    assert sorted(combined) == list(range(num_samples))
    assert len(combined) == len(set(combined))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1

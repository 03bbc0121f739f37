"""Which samples each rank sees: pure functions of (seed, epoch, rank, world size)."""

from __future__ import annotations

import numpy as np
import pytest

from imagenet_elastic.data.sampler import BatchPlan, TrainBatchSampler, epoch_permutation, eval_shard, steps_per_epoch
from imagenet_elastic.errors import UserError

NUM_SAMPLES = 103  # not a multiple of the global batch: the ragged tail is dropped
GLOBAL_BATCH = 8
SEED = 7


def global_batches(world_size: int, epoch: int, start_sample: int = 0, max_steps=None,
                   num_samples: int = NUM_SAMPLES, seed: int = SEED, micro_batch: int = GLOBAL_BATCH,
                   global_batch: int = GLOBAL_BATCH, reps: int = 1) -> list[list[tuple[int, ...]]]:
    """Concatenate every rank's micro-batches of each step into the global batch that step trains on."""
    plan = BatchPlan(global_batch, world_size, micro_batch)
    per_rank = []
    for rank in range(world_size):
        sampler = TrainBatchSampler(num_samples, plan, rank, seed, max_steps=max_steps, reps=reps)
        sampler.set_epoch(epoch, start_sample=start_sample)
        micro = list(sampler)
        assert len(micro) == len(sampler)
        per_rank.append([sum(micro[k:k + plan.accum], []) for k in range(0, len(micro), plan.accum)])
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
def test_set_epoch_start_sample_yields_exactly_the_tail_of_the_epoch(world_size, start_step):
    full = global_batches(world_size, epoch=4)
    tail = global_batches(world_size, epoch=4, start_sample=start_step * GLOBAL_BATCH)
    assert tail == full[start_step:]


@pytest.mark.parametrize("micro_batch", [1, 3, 4, 8])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_micro_batches_do_not_change_the_global_batches(world_size, micro_batch):
    assert global_batches(world_size, epoch=1, micro_batch=micro_batch) == global_batches(1, epoch=1)


def test_resume_at_another_world_size_continues_the_same_permutation():
    """Half an epoch at world size 2, the rest at 1 then 4: every sample once, in the one-rank order."""
    first = global_batches(2, epoch=3)[:5]
    second = global_batches(1, epoch=3, start_sample=5 * GLOBAL_BATCH)[:4]
    third = global_batches(4, epoch=3, start_sample=9 * GLOBAL_BATCH)
    assert first + second + third == global_batches(1, epoch=3)


def test_resume_offset_that_is_not_a_whole_step_continues_from_that_sample():
    """A checkpoint from a run with another global batch: the next sample is the one after the offset."""
    order = epoch_permutation(NUM_SAMPLES, SEED, 2).tolist()
    tail = global_batches(1, epoch=2, start_sample=13)
    assert [i for batch in tail for _, i in batch] == order[13:13 + len(tail) * GLOBAL_BATCH]
    assert len(tail) == (NUM_SAMPLES // GLOBAL_BATCH * GLOBAL_BATCH - 13) // GLOBAL_BATCH


@pytest.mark.parametrize("share,micro,sizes", [(8, 8, [8]), (16, 8, [8, 8]), (12, 8, [6, 6]), (13, 4, [4, 3, 3, 3]),
                                              (5, 8, [5])])
def test_batch_plan_splits_a_share_into_near_equal_micro_batches(share, micro, sizes):
    plan = BatchPlan(global_batch=share * 3, world_size=3, micro_batch=micro)
    for rank in range(3):
        slices = plan.micro_slices(rank)
        assert [s.stop - s.start for s in slices] == sizes
        assert slices[0].start == rank * share and slices[-1].stop == (rank + 1) * share
    assert plan.accum == len(sizes)


def test_len_counts_the_remaining_micro_batches():
    sampler = TrainBatchSampler(NUM_SAMPLES, BatchPlan(GLOBAL_BATCH, 2, 2), 0, SEED)
    steps = NUM_SAMPLES // GLOBAL_BATCH
    assert (len(sampler), sampler.steps_left) == (steps * 2, steps)
    sampler.set_epoch(1, start_sample=3 * GLOBAL_BATCH)
    assert (len(sampler), sampler.steps_left) == ((steps - 3) * 2, steps - 3)
    assert len(list(sampler)) == len(sampler)


def test_keys_are_epoch_index_tuples_of_python_ints():
    sampler = TrainBatchSampler(NUM_SAMPLES, BatchPlan(GLOBAL_BATCH, 2, GLOBAL_BATCH), 1, SEED)
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
        BatchPlan(GLOBAL_BATCH, 3, GLOBAL_BATCH)


def test_dataset_smaller_than_one_global_batch_raises_user_error():
    with pytest.raises(UserError, match="fewer than one global batch") as caught:
        TrainBatchSampler(GLOBAL_BATCH - 1, BatchPlan(GLOBAL_BATCH, 1, GLOBAL_BATCH), 0, SEED)
    assert "--global-batch-size" in str(caught.value)


@pytest.mark.parametrize("num_samples", [1, 7, 10, 11, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_shard_covers_every_index_exactly_once(num_samples, world_size):
    shards = [list(eval_shard(num_samples, rank, world_size)) for rank in range(world_size)]
    combined = [i for shard in shards for i in shard]
    assert sorted(combined) == list(range(num_samples))
    assert len(combined) == len(set(combined))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1


def test_batch_plan_describes_its_split():
    assert BatchPlan(16, 2, 8).describe() == "16 = 2 processes x 8"
    assert BatchPlan(16, 1, 8).describe() == "16 = 1 process x 16, in 2 micro-batches of 8"
    assert BatchPlan(26, 2, 8).describe() == "26 = 2 processes x 13, in 2 micro-batches of 7/6"


def test_repeated_augmentation_puts_each_image_reps_times_in_its_batch_as_distinct_copies():
    """--ra-reps 4 with a global batch of 8: 2 images per step, copy c of image j at position 2c + j."""
    order = epoch_permutation(NUM_SAMPLES, SEED, 2).tolist()
    batches = global_batches(1, 2, reps=4)
    assert len(batches) == NUM_SAMPLES // GLOBAL_BATCH  # an epoch keeps its step count
    for step, batch in enumerate(batches):
        images = order[2 * step:2 * step + 2]
        assert batch == [(2, i, copy) for copy in range(4) for i in images]
    assert len({i for batch in batches for _, i, _ in batch}) == len(batches) * 2  # 1/4 of the images


@pytest.mark.parametrize("start", [0, 3 * GLOBAL_BATCH])
def test_repeated_augmentation_does_not_depend_on_world_size_or_resume_point(start):
    reference = global_batches(1, 4, reps=2, start_sample=start, micro_batch=2)
    for world_size in (2, 4):
        assert global_batches(world_size, 4, reps=2, start_sample=start) == reference, world_size
    assert global_batches(1, 4, reps=2)[start // GLOBAL_BATCH:] == reference


def test_repeated_augmentation_resumed_with_another_global_batch_goes_on_from_the_next_image():
    """A checkpoint of 3 steps of 12 (18 images, twice each) resumed with global batches of 8 (4 images each): the
    steps it says it has, each the next 4 images of the permutation twice over, none seen twice or skipped."""
    order = epoch_permutation(NUM_SAMPLES, SEED, 4).tolist()
    tail = global_batches(1, 4, reps=2, start_sample=3 * 12)
    assert len(tail) == (NUM_SAMPLES // GLOBAL_BATCH * GLOBAL_BATCH - 36) // GLOBAL_BATCH == 7
    for step, batch in enumerate(tail):
        images = order[18 + 4 * step:18 + 4 * step + 4]
        assert batch == [(4, i, copy) for copy in range(2) for i in images]


def test_the_copies_of_an_image_go_to_different_ranks():
    plan = BatchPlan(GLOBAL_BATCH, 4, GLOBAL_BATCH)
    first_step = [next(iter(TrainBatchSampler(NUM_SAMPLES, plan, rank, SEED, reps=4))) for rank in range(4)]
    for rank_keys in first_step:
        assert len({i for _, i, _ in rank_keys}) == len(rank_keys)  # no image twice on one rank


def test_ra_reps_that_does_not_divide_the_global_batch_is_refused():
    with pytest.raises(UserError, match="--ra-reps 3 must divide the global batch"):
        TrainBatchSampler(NUM_SAMPLES, BatchPlan(GLOBAL_BATCH, 1, GLOBAL_BATCH), 0, SEED, reps=3)


def test_all_micro_slices_say_whether_two_world_sizes_train_the_same_micro_batches():
    """2 x 8 and 1 x (8 + 8) train the same micro-batches; 4 x 4 does not (what resume warns about)."""
    two, one, four = BatchPlan(16, 2, 8), BatchPlan(16, 1, 8), BatchPlan(16, 4, 8)
    assert two.all_micro_slices() == one.all_micro_slices() == [slice(0, 8), slice(8, 16)]
    assert four.all_micro_slices() != two.all_micro_slices()

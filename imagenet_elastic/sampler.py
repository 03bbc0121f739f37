"""Which samples each rank sees: pure functions of (seed, epoch, rank, world size).

An epoch is a sequence of *global* batches cut from one permutation that depends only on
(seed, epoch). Rank r of w takes the r-th slice of each global batch, so the global batches, and
with them the optimisation, do not depend on how many ranks share the work.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from imagenet_elastic.errors import UserError

# A sample's key: (epoch, index). The dataset derives the sample's augmentation from it.
SampleKey = tuple[int, int]


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples)


def steps_per_epoch(num_samples: int, global_batch: int, max_steps: int | None = None) -> int:
    """Full global batches per epoch (the ragged tail is dropped), optionally capped."""
    steps = num_samples // global_batch
    if steps == 0:
        raise UserError(
            f"the training set has {num_samples} images, fewer than one global batch of {global_batch}; "
            "lower --batch-size"
        )
    return min(steps, max_steps) if max_steps else steps


def rank_slice(global_batch: int, rank: int, world_size: int) -> slice:
    if global_batch % world_size:
        raise UserError(f"global batch {global_batch} does not split evenly over {world_size} processes")
    per_rank = global_batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


class TrainBatchSampler:
    """Yields this rank's list of sample keys for each step of an epoch, from `start_step` on."""

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int,
                 max_steps: int | None = None) -> None:
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.steps = steps_per_epoch(num_samples, global_batch, max_steps)
        self.share = rank_slice(global_batch, rank, world_size)
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch = epoch
        self.start_step = start_step

    def __len__(self) -> int:
        return self.steps - self.start_step

    def __iter__(self) -> Iterator[list[SampleKey]]:
        order = epoch_permutation(self.num_samples, self.seed, self.epoch)
        for step in range(self.start_step, self.steps):
            batch = order[step * self.global_batch:(step + 1) * self.global_batch]
            yield [(self.epoch, int(i)) for i in batch[self.share]]


def eval_shard(num_samples: int, rank: int, world_size: int) -> range:
    """Every validation sample exactly once across ranks: no padding, no duplicates."""
    return range(rank, num_samples, world_size)

"""Which samples each rank sees: an epoch is a sequence of *global* batches cut from one permutation of (seed, epoch);
rank r of w takes the r-th share of each, in micro-batches. So the optimisation does not depend on the rank count, and
a resume after `k` global samples continues with sample `k` of the same permutation at any world size."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from imagenet_elastic.errors import UserError

# (epoch, index), or (epoch, index, copy) under repeated augmentation: the sample's augmentation derives from it
SampleKey = tuple[int, ...]


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)  # PCG64 seeded by SeedSequence([seed, epoch])


def steps_per_epoch(num_samples: int, global_batch: int, max_steps: int | None = None) -> int:
    """Full global batches per epoch (the ragged tail is dropped), optionally capped."""
    steps = num_samples // global_batch
    if steps == 0:
        raise UserError(f"the training set has {num_samples} images, fewer than one global batch of {global_batch}; "
                        "lower --global-batch-size (or --batch-size)")
    return min(steps, max_steps) if max_steps else steps


def resolve_global_batch(requested: int | None, saved: int | None, batch_size: int, world_size: int) -> int:
    """--global-batch-size, else the checkpoint's (an elastic restart keeps its optimisation), else --batch-size's."""
    return requested or saved or batch_size * world_size


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split: an equal share per rank, each in `accum` micro-batches of at most `micro_batch`
    samples (sizes differ by at most one)."""

    global_batch: int
    world_size: int
    micro_batch: int  # --batch-size: the most samples one forward pass may take

    def __post_init__(self) -> None:
        if self.global_batch % self.world_size:
            raise UserError(f"global batch {self.global_batch} does not split evenly over {self.world_size} processes; "
                            "pass a --global-batch-size that is a multiple of every world size the job may run at")

    @property
    def share(self) -> int:
        return self.global_batch // self.world_size

    @property
    def accum(self) -> int:
        return math.ceil(self.share / self.micro_batch)

    def micro_slices(self, rank: int) -> list[slice]:
        """Positions in the global batch of rank `rank`'s micro-batches, in order."""
        base, extra = divmod(self.share, self.accum)
        ends = list(itertools.accumulate((base + (j < extra) for j in range(self.accum)), initial=rank * self.share))
        return [slice(start, stop) for start, stop in zip(ends, ends[1:])]

    def all_micro_slices(self) -> list[slice]:
        """Every micro-batch of a step, over all ranks, in global-batch order."""
        return [part for rank in range(self.world_size) for part in self.micro_slices(rank)]

    def describe(self) -> str:
        """E.g. `16 = 1 process x 16, in 2 micro-batches of 8`."""
        text = f"{self.global_batch} = {self.world_size} process{'es' * (self.world_size > 1)} x {self.share}"
        if self.accum > 1:
            sizes = sorted({s.stop - s.start for s in self.micro_slices(0)}, reverse=True)
            text += f", in {self.accum} micro-batches of {'/'.join(map(str, sizes))}"
        return text


class TrainBatchSampler:
    """This rank's micro-batches (lists of sample keys) for the rest of an epoch; `set_epoch(epoch, start_sample)`
    resumes after `start_sample` global samples: none seen twice or skipped, whatever the checkpoint's world size."""

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int, seed: int, max_steps: int | None = None,
                 reps: int = 1) -> None:
        if plan.global_batch % reps:
            raise UserError(f"--ra-reps {reps} must divide the global batch ({plan.global_batch}): each global "
                            f"batch holds global-batch / ra-reps images, each {reps} times")
        self.num_samples, self.plan, self.seed, self.reps = num_samples, plan, seed, reps
        self.steps = steps_per_epoch(num_samples, plan.global_batch, max_steps)
        self.slices = plan.micro_slices(rank)
        self.epoch, self.start_sample = 0, 0

    @property
    def samples_per_epoch(self) -> int:
        return self.steps * self.plan.global_batch

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """`start_sample` past the epoch's end (a checkpoint of another global batch near its end): nothing is left."""
        if start_sample < 0:
            raise ValueError(f"start_sample {start_sample} is negative")
        self.epoch, self.start_sample = epoch, min(start_sample, self.samples_per_epoch)

    @property
    def steps_left(self) -> int:
        return (self.samples_per_epoch - self.start_sample) // self.plan.global_batch

    def __len__(self) -> int:
        return self.steps_left * self.plan.accum

    def __iter__(self) -> Iterator[list[SampleKey]]:
        order = epoch_permutation(self.num_samples, self.seed, self.epoch)
        # from any image on, as a checkpoint's global batch may differ (reps divided each: start / reps images)
        unique, first = self.plan.global_batch // self.reps, self.start_sample // self.reps
        for k in range(self.steps_left):
            keys = repeated_batch(order[first + k * unique:first + (k + 1) * unique], self.reps, self.epoch)
            for part in self.slices:
                yield keys[part]


def repeated_batch(group: np.ndarray, reps: int, epoch: int) -> list[SampleKey]:
    """Repeated augmentation (DeiT; torchvision's --ra-reps): a global batch holds the next global_batch / reps images
    (`group`), `reps` times over, copy c at positions c * global_batch / reps + j: its copies fall on other ranks."""
    return [(epoch, int(i), copy) if reps > 1 else (epoch, int(i)) for copy in range(reps) for i in group]


def eval_shard(num_samples: int, rank: int, world_size: int) -> range:
    """Every validation sample exactly once across ranks: no padding, no duplicates."""
    return range(rank, num_samples, world_size)

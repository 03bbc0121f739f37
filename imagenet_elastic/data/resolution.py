"""The training image size of each epoch: one size, or FFCV's progressive resizing, where small images make the early
epochs cheap. A pure function of the epoch, so a worker knows a sample's size from its key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from imagenet_elastic import options
from imagenet_elastic.options import option

MULTIPLE = 32  # sizes on the ramp are rounded to this (FFCV's rule; a ResNet's total stride)


@dataclass(frozen=True)
class TrainSizes:
    size: int  # the size of every epoch, without a ramp
    ramp: Optional[tuple[int, int]] = None  # --progressive-resize LOW,HIGH
    epochs: Optional[tuple[int, int]] = None  # --progressive-epochs START,END, counted from 0

    def __call__(self, epoch: int) -> int:
        """LOW up to epoch START, HIGH from epoch END; linear in between, rounded to a multiple of 32 (half to even,
        as FFCV's numpy rounding does), not 0, and held within LOW..HIGH, which ends off the multiples would pass."""
        if self.ramp is None or self.epochs is None:
            return self.size
        (low, high), (start, end) = self.ramp, self.epochs
        if epoch <= start:
            return low
        if epoch >= end:
            return high
        rounded = round((low + (epoch - start) / (end - start) * (high - low)) / MULTIPLE) * MULTIPLE
        return min(max(rounded, MULTIPLE, low), high)

    @property
    def largest(self) -> int:
        """The largest size of any epoch (HIGH under a ramp): what a batch's bytes are bounded by."""
        return self.size if self.ramp is None or self.epochs is None else max(self.ramp)

    def describe(self, epochs: int) -> str:
        """`160 -> 192 px over epochs 12-14 (160, 192, 192)` for the start-up table."""
        if self.ramp is None or self.epochs is None:
            return f"{self.size} px"
        start, end = self.epochs
        ramp = range(max(0, start), min(epochs, end + 1))
        text = f"{self(0)} -> {self(epochs - 1)} px"
        return text + (f" over epochs {start + 1}-{end + 1} ({', '.join(str(self(e)) for e in ramp)})" if ramp else "")


@dataclass(frozen=True)
class ResolutionSettings:
    """Progressive resizing: the ramp of training's crop size (`TrainSizes`)."""

    progressive_resize: Optional[tuple[int, int]] = option(
        None, "train at LOW px until --progressive-epochs START, then larger each epoch up to HIGH px at END "
        "(FFCV's progressive resizing; sizes rounded to multiples of 32); validation keeps its size", "augment",
        "LOW,HIGH", type=options.side_pair, exact=True)
    progressive_epochs: Optional[tuple[int, int]] = option(
        None, "the epochs (counted from 0, as in FFCV's configs) where --progressive-resize starts and ends its ramp",
        "augment", "START,END", type=options.epoch_pair, exact=True)

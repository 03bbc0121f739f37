"""Learning rate: linear scaling with the global batch, linear warmup, then cosine, linear or step
decay, stepped every iteration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from imagenet_elastic import options
from imagenet_elastic.errors import UserError
from imagenet_elastic.options import option

REFERENCE_BATCH = 256
SCHEDULES = ("cosine", "linear", "step")  # --sched


@dataclass(frozen=True)
class ScheduleSettings:
    """The LR's warmup and its decay (one of `SCHEDULES`)."""

    warmup_epochs: float = option(5.0, "linear warmup, then the decay of --sched, stepped every iteration", "model",
                                  "X", type=options.non_negative_float, exact=True)
    sched: str = option("cosine", "LR decay after the warmup: cosine or linear (FFCV's triangle) to --lr-min at the "
                        "last step, or step (x --decay-rate every --decay-epochs, counted from the first epoch)",
                        "model", choices=list(SCHEDULES), exact=True)
    lr_min: float = option(0.0, "the LR cosine ends at; the floor of step decay; at most the peak LR (--lr x global "
                           "batch / 256)", "model", "X", type=options.non_negative_float, exact=True)
    decay_epochs: float = option(30.0, "step decay: epochs between two decays", "model", "X",
                                 type=options.positive_float, exact=True)
    decay_rate: float = option(0.1, "step decay: the factor", "model", "X", type=options.positive_float, exact=True)


def scaled_lr(base_lr: float, global_batch: int) -> float:
    """Goyal et al.'s linear scaling rule: `base_lr` is the LR for a global batch of 256."""
    return base_lr * global_batch / REFERENCE_BATCH


@dataclass(frozen=True)
class LRSchedule:
    peak: float
    warmup_steps: int
    total_steps: int
    minimum: float = 0.0  # --lr-min: where cosine ends, and the floor of step decay
    kind: str = "cosine"
    decay_every: int = 1  # step decay: optimizer steps between two decays
    decay_rate: float = 0.1

    def __post_init__(self) -> None:
        """--lr-min is absolute, --lr scaled with the global batch: a minimum above the peak makes every decay rise."""
        if self.minimum > self.peak:
            raise UserError(f"--lr-min {self.minimum:g} is above the peak LR {self.peak:g} that --lr gives at this "
                            f"global batch (--lr x global batch / {REFERENCE_BATCH}): the LR would rise after the "
                            "warmup; lower --lr-min or raise --lr")

    def at(self, step: int) -> float:
        """LR for optimizer step `step` (0-based): warmup from peak/warmup to peak, then the decay."""
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "step":  # torchvision's StepLR: counted from the first step, as its epochs are
            return max(self.minimum, self.peak * self.decay_rate ** (step // self.decay_every))
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.kind == "linear":  # FFCV's triangular schedule, with the warmup
            return self.peak + (self.minimum - self.peak) * progress
        return self.minimum + 0.5 * (self.peak - self.minimum) * (1.0 + math.cos(math.pi * progress))

    def describe(self) -> str:
        decay = (f"x{self.decay_rate:g} every {self.decay_every} steps" if self.kind == "step"
                 else f"{self.kind} over {self.total_steps}")
        return f"warmup {self.warmup_steps} steps, {decay}" + (f", down to {self.minimum:g}" if self.minimum else "")

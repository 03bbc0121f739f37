"""Learning rate: linear scaling with the global batch, linear warmup, cosine decay per iteration."""

from __future__ import annotations

import math

REFERENCE_BATCH = 256


def scaled_lr(base_lr: float, global_batch: int) -> float:
    """Goyal et al.'s linear scaling rule: `base_lr` is the LR for a global batch of 256."""
    return base_lr * global_batch / REFERENCE_BATCH


def lr_at(step: int, peak_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): warmup from peak/warmup to peak, then cosine to 0."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * peak_lr * (1.0 + math.cos(math.pi * progress))

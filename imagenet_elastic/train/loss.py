"""The training loss: cross-entropy or timm's binary cross-entropy, with label smoothing, on class
labels or on the soft targets of mixed images (mixing.Mixer)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class TrainLoss(nn.Module):
    """`loss(logits, targets)`: targets are class indices, or probabilities not yet smoothed. Smoothing moves a
    probability target towards uniform (t (1 - s) + s / classes), as torch's cross-entropy and timm's BCE do for an
    index; timm's BCE expects smoothed targets (its Mixup smooths them), so they are smoothed here."""

    def __init__(self, label_smoothing: float, bce: bool = False, bce_threshold: Optional[float] = None) -> None:
        super().__init__()
        self.smoothing, self.bce = label_smoothing, bce
        if bce:
            from timm.loss import BinaryCrossEntropy

            self.loss: nn.Module = BinaryCrossEntropy(smoothing=label_smoothing, target_threshold=bce_threshold)
        else:
            self.loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.bce and targets.is_floating_point() and self.smoothing:
            targets = targets * (1.0 - self.smoothing) + self.smoothing / logits.shape[-1]
        return self.loss(logits, targets)

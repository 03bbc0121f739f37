"""The training loss: class labels and probability targets give the same loss, smoothing included,
for cross-entropy and timm's binary cross-entropy (--bce-loss); --drop-path reaches timm's model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from imagenet_elastic.errors import UserError
from imagenet_elastic.models.create import create_model
from imagenet_elastic.train.step import TrainLoss


@pytest.mark.parametrize("bce", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_one_hot_targets_give_the_loss_of_their_labels(bce, smoothing):
    logits, labels = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 4, 0])
    loss = TrainLoss(smoothing, bce)
    assert torch.allclose(loss(logits, labels), loss(logits, F.one_hot(labels, 5).float()), atol=1e-6)


def test_bce_is_timms_per_class_logistic_loss_on_smoothed_targets():
    logits, labels = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2, 1, 1])
    targets = F.one_hot(labels, 3).float() * 0.9 + 0.1 / 3
    expected = F.binary_cross_entropy_with_logits(logits, targets)
    assert torch.allclose(TrainLoss(0.1, bce=True)(logits, labels), expected, atol=1e-6)
    thresholded = TrainLoss(0.1, bce=True, bce_threshold=0.2)(logits, labels)  # smoothed targets back to 0/1
    assert torch.allclose(thresholded, F.binary_cross_entropy_with_logits(logits, F.one_hot(labels, 3).float()))


def test_cross_entropy_of_a_mixed_target_is_the_mix_of_the_two_losses():
    logits = torch.randn(1, 4, generator=torch.Generator().manual_seed(2))
    loss = TrainLoss(0.1)
    mixed = 0.3 * F.one_hot(torch.tensor([1]), 4).float() + 0.7 * F.one_hot(torch.tensor([3]), 4).float()
    expected = 0.3 * loss(logits, torch.tensor([1])) + 0.7 * loss(logits, torch.tensor([3]))
    assert torch.allclose(loss(logits, mixed), expected, atol=1e-6)


def test_drop_path_reaches_the_model_and_a_model_without_it_is_named():
    model = create_model("test_resnet", 4, drop_path=0.2)
    rates = [m.drop_prob for m in model.modules() if type(m).__name__ == "DropPath"]
    assert rates and max(rates) == pytest.approx(0.2)
    assert not [m for m in create_model("test_resnet", 4).modules() if type(m).__name__ == "DropPath"]
    with pytest.raises(UserError, match="--drop-path: timm's ghostnet_050 has no drop_path_rate"):
        create_model("ghostnet_050", 4, drop_path=0.1)

"""The teacher on the device: frozen, in eval mode, without gradients, in the run's precision and memory layout, on
the student's batch as its own preprocessing would have made it.

It sees the student's augmented and mixed images, renormalised with its own mean and std and, where its input size
is another, resized on the device (bilinear, antialiased, as torchvision and timm resize); where they agree it sees
the student's very tensor. Under DDP it is not wrapped: each rank holds its own copy, and nothing of it is reduced."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.models.device import place_model
from imagenet_elastic.models.teacher_weights import TeacherInput, TeacherWeights


class Teacher:
    """`teacher(images)`: the teacher's logits (float32) for a batch the student's `input` prepared."""

    def __init__(self, weights: TeacherWeights, student: ModelInput) -> None:
        self.model = place_model(weights.model, student.device, student.channels_last).eval().requires_grad_(False)
        self.student, self.wanted = student, weights.input
        self.scale, self.shift = renormalisation(student, weights.input)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.student.autocast():
            return self.model(self.preprocess(images)).float()

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """The student's batch (NCHW, normalised for the student) as the teacher's own preprocessing gives it."""
        if self.scale is not None:
            images = torch.addcmul(self.shift, images, self.scale)
        if tuple(images.shape[-2:]) != self.wanted.size:
            images = F.interpolate(images, size=self.wanted.size, mode="bilinear", antialias=True, align_corners=False)
        return images  # in the student's memory layout, which both operations keep


def renormalisation(student: ModelInput, teacher: TeacherInput
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(scale, shift) with teacher = student x scale + shift, per channel: undo the student's normalisation, apply the
    teacher's ((x s_s + m_s - m_t) / s_t). (None, None) where the two are the same: the batch is left as it is."""
    mean, std = (torch.tensor(v, dtype=torch.float64, device=student.device).view(1, 3, 1, 1)
                 for v in (teacher.mean, teacher.std))
    if torch.equal(mean.float(), student.mean.float()) and torch.equal(std.float(), student.std.float()):
        return None, None
    scale = student.std.double() / std
    shift = (student.mean.double() - mean) / std
    return scale.float(), shift.float()

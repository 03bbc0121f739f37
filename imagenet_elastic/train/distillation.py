"""Knowledge distillation's loss, as timm 1.0 defines it (timm/task/distillation.py and token_distillation.py):
logit distillation, for any student, is KL(teacher || student) at temperature T, batch mean, times T^2 (the gradient
keeps its scale as T changes; Hinton et al.); token distillation, for a student with DeiT's distillation head
(`*_distilled_*`), teaches the class head the task and the distillation head the teacher, soft (the same KL) or hard
(cross-entropy with the teacher's top class); in eval mode timm averages the two heads, and validation scores that."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.models.device import place_model
from imagenet_elastic.models.teacher_weights import TeacherInput, TeacherWeights

LOGIT, SOFT, HARD = "logit", "soft", "hard"  # SOFT and HARD: --kd-token-distill-type's


def loss_weights(task: Optional[float], distill: Optional[float]) -> tuple[float, float]:
    """timm train.py's --task-loss-weight and --distill-loss-weight: the distillation's weight given, each is its own
    (the task's 1 when unset); only the task's given, the distillation takes the rest (1 - task); neither, 1 and 1."""
    if distill is not None:
        return (1.0 if task is None else task), distill
    if task is not None:
        return task, 1.0 - task
    return 1.0, 1.0


def has_distillation_head(model: nn.Module) -> bool:
    """timm's models with DeiT's distillation token and head (VisionTransformerDistilled) say so by this method."""
    return hasattr(model, "set_distilled_training")


class Distillation:
    """`distillation(outputs, targets, images, criterion)`: the micro-batch's loss and its parts (float32, detached:
    [loss, task loss, distillation loss]) from the student's `outputs` on `images` and the teacher's on the same."""

    parts = ("task_loss", "distill_loss")  # what a step tallies beside its loss (state.EpochTally.parts)

    def __init__(self, teacher: Callable[[torch.Tensor], torch.Tensor], kind: str, temperature: float,
                 task_weight: float, distill_weight: float) -> None:
        self.teacher, self.kind, self.temperature = teacher, kind, temperature
        self.task_weight, self.distill_weight = task_weight, distill_weight

    def __call__(self, outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor,
                 images: torch.Tensor, criterion: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        taught = self.teacher(images)
        if self.kind == LOGIT:
            own = learner = outputs
        else:
            own, learner = outputs  # the class head's logits, the distillation head's
        task = criterion(own, targets)
        if self.kind == HARD:  # DeiT's: cross-entropy with the teacher's top class
            distill = F.cross_entropy(learner.float(), taught.argmax(dim=-1))
        else:  # KL(teacher || student) at temperature T, the batch's mean, x T^2
            t = self.temperature
            distill = F.kl_div(F.log_softmax(learner.float() / t, dim=-1), F.log_softmax(taught.float() / t, dim=-1),
                               reduction="batchmean", log_target=True) * t ** 2
        loss = self.task_weight * task + self.distill_weight * distill
        return loss, torch.stack([loss, task, distill]).detach().float()

    def describe(self) -> str:
        """For the start-up table: which distillation, and the loss it makes."""
        what = {LOGIT: f"logit distillation: KL at T={self.temperature:g} (x T^2)",
                SOFT: f"token distillation, soft: the distillation head's KL at T={self.temperature:g} (x T^2)",
                HARD: "token distillation, hard: the distillation head's cross-entropy with the teacher's top class"}
        return f"{what[self.kind]}; loss = {self.task_weight:g} x task + {self.distill_weight:g} x distillation"


class Teacher:
    """`teacher(images)`: the teacher's logits (float32) for the student's augmented, mixed batch, renormalised to
    the teacher's mean and std and resized to its input size on the device (bilinear, antialiased, as torchvision and
    timm) where they differ. Frozen, eval mode, the run's precision; not DDP-wrapped: each rank's own copy."""

    def __init__(self, weights: TeacherWeights, student: ModelInput) -> None:
        self.model = place_model(weights.model, student.device, student.channels_last).eval().requires_grad_(False)
        self.student, self.wanted = student, weights.input
        self.scale, self.shift = renormalisation(student, weights.input)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.student.autocast():
            if self.scale is not None:
                images = torch.addcmul(self.shift, images, self.scale)
            if tuple(images.shape[-2:]) != self.wanted.size:
                images = F.interpolate(images, size=self.wanted.size, mode="bilinear", antialias=True,
                                       align_corners=False)
            return self.model(images).float()


def renormalisation(student: ModelInput, teacher: TeacherInput
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(scale, shift) with teacher = student x scale + shift, per channel: undo the student's normalisation, apply the
    teacher's ((x s_s + m_s - m_t) / s_t). (None, None) where the two are the same: the batch is left as it is."""
    mean, std = (torch.tensor(v, dtype=torch.float64, device=student.device).view(1, 3, 1, 1)
                 for v in (teacher.mean, teacher.std))
    if torch.equal(mean.float(), student.mean.float()) and torch.equal(std.float(), student.std.float()):
        return None, None
    return (student.std.double() / std).float(), ((student.mean.double() - mean) / std).float()

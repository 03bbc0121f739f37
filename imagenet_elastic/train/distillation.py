"""Knowledge distillation's loss, as timm 1.0 defines it (timm/task/distillation.py and token_distillation.py):
logit distillation, for any student, is the KL divergence from the teacher's distribution to the student's, both at
temperature T, batch mean, times T^2 (so the gradient keeps its scale as T changes; Hinton et al.); token
distillation, for a student with DeiT's distillation head (`*_distilled_*`), teaches the class head the task and the
distillation head the teacher, soft (the same KL) or hard (cross-entropy with the teacher's top class); in eval mode
timm averages the two heads, so validation scores that average. The total weighs task and distillation losses
(`loss_weights`); the teacher sees the same mixed images (teacher.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

LOGIT, SOFT, HARD = "logit", "soft", "hard"
TOKEN_KINDS = (SOFT, HARD)  # --kd-token-distill-type
PARTS = ("task_loss", "distill_loss")  # what a distilling step tallies beside its loss (state.EpochTally.parts)


def loss_weights(task: Optional[float], distill: Optional[float]) -> tuple[float, float]:
    """timm train.py's --task-loss-weight and --distill-loss-weight: the distillation's weight given, each is its own
    (the task's 1 when unset); only the task's given, the distillation takes the rest (1 - task); neither, 1 and 1."""
    if distill is not None:
        return (1.0 if task is None else task), distill
    if task is not None:
        return task, 1.0 - task
    return 1.0, 1.0


def soft_distillation(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the distributions at `temperature`, the batch's mean, x temperature^2."""
    log_student = F.log_softmax(student.float() / temperature, dim=-1)
    log_teacher = F.log_softmax(teacher.float() / temperature, dim=-1)
    return F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) * temperature ** 2


def hard_distillation(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student's logits with the teacher's top class (DeiT's hard distillation)."""
    return F.cross_entropy(student.float(), teacher.argmax(dim=-1))


def has_distillation_head(model: nn.Module) -> bool:
    """timm's models with DeiT's distillation token and head (VisionTransformerDistilled) say so by this method."""
    return hasattr(model, "set_distilled_training")


class Distillation:
    """`distillation(outputs, targets, images, criterion)`: the micro-batch's loss and its parts (float32, detached:
    [loss, task loss, distillation loss]) from the student's `outputs` on `images` and the teacher's on the same."""

    parts = PARTS

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
        distill = hard_distillation(learner, taught) if self.kind == HARD else \
            soft_distillation(learner, taught, self.temperature)
        loss = self.task_weight * task + self.distill_weight * distill
        return loss, torch.stack([loss, task, distill]).detach().float()

    def describe(self) -> str:
        """For the start-up table: which distillation, and the loss it makes."""
        what = {LOGIT: f"logit distillation: KL at T={self.temperature:g} (x T^2)",
                SOFT: f"token distillation, soft: the distillation head's KL at T={self.temperature:g} (x T^2)",
                HARD: "token distillation, hard: the distillation head's cross-entropy with the teacher's top class"}
        return f"{what[self.kind]}; loss = {self.task_weight:g} x task + {self.distill_weight:g} x distillation"

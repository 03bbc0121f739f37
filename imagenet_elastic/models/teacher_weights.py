"""--teacher: the model a run distils from, read before any data is scanned, with the input it expects. Its classes
must be the data's, in order; checkpoints keep its identity, never its weights; a resume with another teacher is
refused."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from imagenet_elastic.config import saved_eval_sizes
from imagenet_elastic.data.model_input import IMAGENET_MEAN, IMAGENET_STD
from imagenet_elastic.errors import UserError
from imagenet_elastic.models.weights import CHECKPOINT, Weights, load_weights

FLAG = "--teacher"


@dataclass(frozen=True)
class TeacherInput:
    """The teacher's own preprocessing: image (height, width) in px, normalising mean and std on 0-255 levels."""

    size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def saved(self) -> dict[str, list]:
        return {"size": list(self.size), "mean": list(self.mean), "std": list(self.std)}

    def describe(self) -> str:
        size = f"{self.size[0]} px" if self.size[0] == self.size[1] else f"{self.size[0]}x{self.size[1]} px"
        return (f"{size}, mean {'/'.join(f'{m / 255:.3f}' for m in self.mean)}, std "
                f"{'/'.join(f'{s / 255:.3f}' for s in self.std)}")


@dataclass(frozen=True)
class TeacherWeights(Weights):
    """The teacher as read, with what a run checks and keeps of it."""

    spec: str  # what --teacher said
    input: TeacherInput
    sha256: str  # of its weights (weights_hash)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint keeps of the teacher: enough to recognise it, nothing to rebuild it."""
        return {"spec": self.spec, "sha256": self.sha256, "input": self.input.saved()}


def read(spec: str) -> TeacherWeights:
    """The teacher `spec` names, with its input (timm's pretrained_cfg; for our checkpoint, our validation's crop and
    normalisation) and identity; a UserError naming --teacher where it cannot be read."""
    loaded = load_weights(spec, FLAG)
    if not loaded.classes:
        raise UserError(f"{FLAG} {spec} has no classifier: a teacher's logits are what the student learns from")
    source = loaded.source
    if loaded.kind == CHECKPOINT:
        crop = saved_eval_sizes(loaded.settings)[0]
        wanted = TeacherInput((crop, crop), IMAGENET_MEAN, IMAGENET_STD)
        source += f" ({loaded.read})" if loaded.read != spec else ""
    else:
        wanted = timm_input(loaded.model)
    return TeacherWeights(loaded.model, loaded.kind, loaded.read, source, loaded.class_names, loaded.settings,
                          loaded.val_print, spec=spec, input=wanted, sha256=weights_hash(loaded.model))


def timm_input(model: nn.Module) -> TeacherInput:
    """The input timm's pretrained_cfg says the model expects (its defaults where it says nothing)."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    cfg = getattr(model, "pretrained_cfg", {}) or {}
    _, height, width = cfg.get("input_size", (3, 224, 224))
    return TeacherInput((int(height), int(width)), tuple(255 * m for m in cfg.get("mean", IMAGENET_DEFAULT_MEAN)),
                        tuple(255 * s for s in cfg.get("std", IMAGENET_DEFAULT_STD)))


def weights_hash(model: nn.Module) -> str:
    """SHA-256 of the model's state dict: each entry's name, dtype and shape, then its bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def check_classes(teacher: TeacherWeights, classes: tuple[str, ...]) -> None:
    """Teacher and student predict the same classes: the count always, the names where the teacher's are known (a
    checkpoint's, an export's label_names), in order, since output k of the one teaches output k of the other."""
    if teacher.classes != len(classes):
        raise UserError(f"{FLAG} {teacher.spec} predicts {teacher.classes} classes, the data has {len(classes)}: "
                        "the teacher must predict the student's classes")
    if teacher.class_names is not None and teacher.class_names != classes:
        k = next(i for i, (theirs, ours) in enumerate(zip(teacher.class_names, classes)) if theirs != ours)
        raise UserError(f"{FLAG} {teacher.spec} was trained on other class names than the data's: its class {k} is "
                        f"{teacher.class_names[k]!r}, the data's {classes[k]!r}")


def compare(saved: Optional[dict[str, Any]], teacher: Optional[TeacherWeights], path: str) -> Optional[str]:
    """A checkpoint's teacher (`saved`: its identity, None: none) against this run's: a UserError naming both when
    they differ (other weights, or another input); a change to warn of when one of the two has none; else None."""
    if saved is None or teacher is None:
        was, now = saved["spec"] if saved else "none", teacher.spec if teacher else "none"
        return None if saved is None and teacher is None else f"teacher: checkpoint {was}, now {now}"
    if saved["sha256"] != teacher.sha256 or saved["input"] != teacher.input.saved():
        was = "other weights" if saved["sha256"] != teacher.sha256 else "another input"
        raise UserError(f"checkpoint {path} was distilled from {FLAG} {saved['spec']} (sha256 {saved['sha256'][:12]}), "
                        f"not from {teacher.spec} (sha256 {teacher.sha256[:12]}, {was}): resume with the same teacher")
    return None

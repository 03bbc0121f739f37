"""--teacher: the model a run distils from, read once at the start, before any data is scanned.

Three sources, told apart as timm's reader factory tells datasets apart (by form first, then on disk): a file
(`best.pt`) is one of our checkpoints, its raw weights, and so is a run's checkpoints folder (its best.pt); a folder
with config.json is an export (`imagenet-elastic export`), read as timm's `local-dir:`; anything else a timm name
with published weights (`resnet50.a1_in1k`, `hf-hub:ORG/NAME`, `local-dir:FOLDER`), through the same Hugging Face
cache and offline rules as --pretrained (published_weights.py). What the teacher expects of its input comes with it:
timm's pretrained_cfg (input size, mean, std) for published weights and exports, our validation's crop and
normalisation for a checkpoint. So do its classes: a checkpoint's, or an export's config.json `label_names`, must be
the data's, in order (`check_classes`).

The teacher's weights never go into our checkpoints, only its identity (`identity`: what --teacher said, a SHA-256
of its weights, its input), and a resume from a checkpoint distilled from another teacher is refused (`compare`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from imagenet_elastic.checkpoint import store
from imagenet_elastic.config import WEIGHT_SOURCES, eval_sizes, saved_setting
from imagenet_elastic.data.model_input import IMAGENET_MEAN, IMAGENET_STD
from imagenet_elastic.errors import UserError
from imagenet_elastic.models import published_weights, tiny_models
from imagenet_elastic.models.blurpool import blur_strided_convs
from imagenet_elastic.models.create import create_model
from imagenet_elastic.models.input_size import saved_sizes

CHECKPOINT, EXPORT, PUBLISHED = "checkpoint", "export", "published"
FLAG = "--teacher"


@dataclass(frozen=True)
class TeacherInput:
    """What the teacher's own preprocessing makes of an image: its side (height, width) in pixels, and the mean and
    std it is normalised with, on 0-255 levels (as data/model_input.ModelInput has them)."""

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
class TeacherWeights:
    """The teacher as read: its model on the CPU (train.teacher.Teacher freezes it), and what is known of it."""

    model: nn.Module
    spec: str  # what --teacher said
    kind: str  # CHECKPOINT, EXPORT or PUBLISHED
    source: str  # what its weights are and where they came from, for the start-up table
    classes: int
    class_names: Optional[tuple[str, ...]]  # a checkpoint's classes, an export's label_names; None where unsaid
    input: TeacherInput
    sha256: str  # of its weights (weights_hash)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint keeps of the teacher: enough to recognise it, nothing to rebuild it."""
        return {"spec": self.spec, "sha256": self.sha256, "input": self.input.saved()}


def resolve(spec: str) -> tuple[str, str]:
    """What --teacher `spec` is, and the file, folder or timm name to read: a checkpoint (a file, a `.pt` path, or
    a run's checkpoints folder: its best.pt), an export (a folder with config.json), else a timm name. What is none
    of these is one line saying every reading that was tried, in the words the user wrote (not timm's
    `local-dir:...` or "Unknown model")."""
    if spec.endswith(".pt") or os.path.isfile(spec):
        return CHECKPOINT, spec
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "config.json")):
            return EXPORT, spec
        if os.path.isfile(os.path.join(spec, store.BEST)):
            return CHECKPOINT, os.path.join(spec, store.BEST)
        raise UserError(f"{FLAG} {spec}: a folder with neither config.json (an export: imagenet-elastic export) nor "
                        f"{store.BEST} (a run's checkpoints folder)")
    if not spec.startswith(WEIGHT_SOURCES):
        import timm

        tiny_models.register()
        if os.sep in spec or not timm.is_model(spec):
            where = "no such file or folder" + ("" if os.sep in spec else ", and no model timm knows by that name")
            raise UserError(f"{FLAG} {spec}: {where}")
    return PUBLISHED, spec


def read(spec: str) -> TeacherWeights:
    """The teacher `spec` names, frozen, its identity computed; a UserError naming --teacher where it cannot be read."""
    kind, target = resolve(spec)
    if kind == CHECKPOINT:
        model, source, classes, names, wanted = from_checkpoint(target)
        source += f" ({target})" if target != spec else ""
    else:
        model = published_weights.create(f"local-dir:{target}" if kind == EXPORT else target, FLAG)
        architecture = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", spec)
        names = None
        if kind == EXPORT or spec.startswith("local-dir:"):
            config = folder_config(spec.removeprefix("local-dir:"))
            blur_if_exported_with_it(model, config)
            names = exported_class_names(config)
            source = f"a folder of {architecture} weights (an export, or timm's save_for_hf)"
        else:
            where = published_weights.describe_source(model, spec)
            source = f"published weights of {architecture}" + (f": {where}" if where != spec else "")
        head = model.get_classifier() if hasattr(model, "get_classifier") else None
        classes = getattr(model, "num_classes", 0) if head is not None else 0
        wanted = timm_input(model)
    if not classes:
        raise UserError(f"{FLAG} {spec} has no classifier: a teacher's logits are what the student learns from")
    return TeacherWeights(model, spec, kind, source, classes, names, wanted, weights_hash(model))


def from_checkpoint(path: str) -> tuple[nn.Module, str, int, tuple[str, ...], TeacherInput]:
    """One of our checkpoints as a teacher: its model with its raw weights, and the input its validation used."""
    try:
        snapshot = store.load(path)
    except UserError as error:
        raise UserError(f"{FLAG}: {error}") from None
    settings = snapshot.get("config", {})
    names = tuple(snapshot["classes"])
    model = create_model(snapshot["model_name"], len(names), blurpool=saved_setting(settings, "blurpool"),
                         sizes=saved_sizes(settings))
    model.load_state_dict(snapshot["model"])
    crop = eval_sizes(saved_setting(settings, "image_size"), settings.get("val_crop_size"),
                      settings.get("val_resize"))[0]
    source = f"our checkpoint of {snapshot['model_name']}, its raw weights after step {snapshot['step']}"
    return model, source, len(names), names, TeacherInput((crop, crop), IMAGENET_MEAN, IMAGENET_STD)


def timm_input(model: nn.Module) -> TeacherInput:
    """The input timm's pretrained_cfg says the model expects (its defaults where it says nothing)."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    cfg = getattr(model, "pretrained_cfg", {}) or {}
    _, height, width = cfg.get("input_size", (3, 224, 224))
    return TeacherInput((int(height), int(width)), tuple(255 * m for m in cfg.get("mean", IMAGENET_DEFAULT_MEAN)),
                        tuple(255 * s for s in cfg.get("std", IMAGENET_DEFAULT_STD)))


def folder_config(folder: str) -> dict[str, Any]:
    """A folder's config.json (an export's, or timm's save_for_hf's), or {} where it has none readable."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def blur_if_exported_with_it(model: nn.Module, config: dict[str, Any]) -> None:
    """An export of a --blurpool run says so in its config.json, and timm builds no blur: give it back."""
    extra = config.get("imagenet_elastic", {})
    if isinstance(extra, dict) and extra.get("blurpool"):
        blur_strided_convs(model)


def exported_class_names(config: dict[str, Any]) -> Optional[tuple[str, ...]]:
    """The class of each output, from config.json's `label_names` (an export writes the class folders there; timm
    allows a list, or a dict from output index to name); None where it names none."""
    names = config.get("label_names")
    if isinstance(names, dict):
        by_index = {str(k): v for k, v in names.items()}
        names = [by_index[str(i)] for i in range(len(by_index))] if all(
            str(i) in by_index for i in range(len(by_index))) else None
    return tuple(str(n) for n in names) if isinstance(names, (list, tuple)) and names else None


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
    if saved is None and teacher is None:
        return None
    if saved is None:
        return f"teacher: checkpoint none, now {teacher.spec}"
    if teacher is None:
        return f"teacher: checkpoint {saved['spec']}, now none"
    if saved["sha256"] != teacher.sha256 or saved["input"] != teacher.input.saved():
        was = "other weights" if saved["sha256"] != teacher.sha256 else "another input"
        raise UserError(f"checkpoint {path} was distilled from {FLAG} {saved['spec']} (sha256 {saved['sha256'][:12]}), "
                        f"not from {teacher.spec} (sha256 {teacher.sha256[:12]}, {was}): resume with the same teacher")
    return None

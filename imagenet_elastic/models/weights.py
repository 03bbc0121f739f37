"""A whole model from what a user names as its weights: the one loader behind --teacher and `imagenet-elastic
evaluate MODEL`.

Told apart by form first, then on disk (as timm's reader factory does): our checkpoint (a file, or a run's
checkpoints folder: its best.pt), an export (a folder with config.json: timm's `local-dir:`), else a timm name with
published weights (--pretrained's cache and offline rules). The model comes on the CPU with its classes and, for a
checkpoint, its run's settings and validation data."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from imagenet_elastic.checkpoint import store
from imagenet_elastic.config import WEIGHT_SOURCES, saved_setting
from imagenet_elastic.errors import UserError
from imagenet_elastic.models import published_weights, tiny_models
from imagenet_elastic.models.blurpool import blur_strided_convs
from imagenet_elastic.models.create import create_model
from imagenet_elastic.models.input_size import saved_sizes

CHECKPOINT, EXPORT, PUBLISHED = "checkpoint", "export", "published"


@dataclass(frozen=True)
class Weights:
    model: nn.Module  # on the CPU
    kind: str  # CHECKPOINT, EXPORT or PUBLISHED
    read: str  # the file, folder or timm name read (a run's checkpoints folder: its best.pt)
    source: str  # what the weights are and where they came from, in words
    class_names: Optional[tuple[str, ...]]  # a checkpoint's classes, an export's label_names; None where unsaid
    settings: Optional[dict[str, Any]] = None  # a checkpoint's run's settings (how it validated)
    val_print: Optional[dict[str, Any]] = None  # a checkpoint's fingerprint of its run's validation split

    @property
    def classes(self) -> int:
        """The classifier's outputs; 0 for a model without one (a feature extractor)."""
        head = self.model.get_classifier() if hasattr(self.model, "get_classifier") else None
        return getattr(self.model, "num_classes", 0) if head is not None else 0


def resolve(spec: str, flag: str) -> tuple[str, str]:
    """What `spec` is (CHECKPOINT, EXPORT, PUBLISHED) and what to read; what is none of these is one line saying
    every reading tried (not timm's `local-dir:...` or "Unknown model")."""
    if spec.endswith(".pt") or os.path.isfile(spec):
        return CHECKPOINT, spec
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "config.json")):
            return EXPORT, spec
        if os.path.isfile(os.path.join(spec, store.BEST)):
            return CHECKPOINT, os.path.join(spec, store.BEST)
        raise UserError(f"{flag} {spec}: a folder with neither config.json (an export: imagenet-elastic export) nor "
                        f"{store.BEST} (a run's checkpoints folder)")
    if not spec.startswith(WEIGHT_SOURCES):
        import timm

        tiny_models.register()
        if os.sep in spec or not timm.is_model(spec):
            where = "no such file or folder" + ("" if os.sep in spec else ", and no model timm knows by that name")
            raise UserError(f"{flag} {spec}: {where}")
    return PUBLISHED, spec


def load_weights(spec: str, flag: str, ema: bool = False, published: bool = True) -> Weights:
    """The model `spec` names (`resolve`); `ema`: a checkpoint's weight average instead of its raw weights;
    `published`: whether a timm name's published weights may be read (`evaluate` asks for --pretrained first)."""
    kind, target = resolve(spec, flag)
    if kind == CHECKPOINT:
        return from_checkpoint(target, flag, ema)
    if kind == PUBLISHED and not published:
        raise UserError(f"{flag} {spec} is a timm model name: reading its published weights needs --pretrained")
    if ema:
        raise UserError(f"--ema applies to our checkpoints only, not to {flag} {spec}")
    model = published_weights.create(f"local-dir:{target}" if kind == EXPORT else target, flag)
    architecture = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", spec)
    if kind == EXPORT or spec.startswith("local-dir:"):
        config = folder_config(spec.removeprefix("local-dir:"))
        if isinstance(config.get("imagenet_elastic"), dict) and config["imagenet_elastic"].get("blurpool"):
            blur_strided_convs(model)  # an export of a --blurpool run says so, and timm builds no blur: give it back
        return Weights(model, kind, target, f"a folder of {architecture} weights (an export, or timm's save_for_hf)",
                       exported_class_names(config))
    where = published_weights.describe_source(model, spec)
    return Weights(model, kind, target,
                   f"published weights of {architecture}" + (f": {where}" if where != spec else ""), None)


def from_checkpoint(path: str, flag: str, ema: bool) -> Weights:
    """One of our checkpoints: its model with its raw weights (or their average), its classes and its run's settings."""
    try:
        snapshot = store.load(path)
    except UserError as error:
        raise UserError(f"{flag}: {error}") from None
    weights = snapshot.get("model_ema") if ema else snapshot.get("model")
    if weights is None:
        raise UserError(f"checkpoint {path} has no weight average (it was trained without --model-ema): use it "
                        "without --ema" if ema else f"checkpoint {path} holds no model weights")
    settings = snapshot.get("config", {})
    names = tuple(snapshot["classes"])
    model = create_model(snapshot["model_name"], len(names), blurpool=saved_setting(settings, "blurpool"),
                         sizes=saved_sizes(settings))
    model.load_state_dict(weights)
    which = "weight average" if ema else "raw weights"
    return Weights(model, CHECKPOINT, path, f"our checkpoint of {snapshot['model_name']}, its {which} after step "
                   f"{snapshot['step']}", names, settings, (snapshot.get("data") or {}).get("val"))


def folder_config(folder: str) -> dict[str, Any]:
    """A folder's config.json (an export's, or timm's save_for_hf's), or {} where it has none readable."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def exported_class_names(config: dict[str, Any]) -> Optional[tuple[str, ...]]:
    """Each output's class from config.json's `label_names` (a list, or index -> name), or None."""
    names = config.get("label_names")
    if isinstance(names, dict):
        by_index = {str(k): v for k, v in names.items()}
        names = [by_index[str(i)] for i in range(len(by_index))] if all(
            str(i) in by_index for i in range(len(by_index))) else None
    return tuple(str(n) for n in names) if isinstance(names, (list, tuple)) and names else None

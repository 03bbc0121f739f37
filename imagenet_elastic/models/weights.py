"""Weights a user names (--pretrained, --initial-checkpoint, --teacher, `imagenet-elastic evaluate MODEL`), read once
at the start, before any data scan, so a missing file costs seconds. Published weights come through the Hugging Face
hub cache (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE): an offline node reads what an earlier download left."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from imagenet_elastic.checkpoint import store
from imagenet_elastic.config import WEIGHT_SOURCES, saved_setting
from imagenet_elastic.errors import UserError, first_line
from imagenet_elastic.models import tiny_models
from imagenet_elastic.models.blurpool import blur_strided_convs
from imagenet_elastic.models.create import check_model_name, create_model, saved_sizes

CHECKPOINT, EXPORT, PUBLISHED = "checkpoint", "export", "published"


def classifier(model: nn.Module) -> Optional[nn.Module]:
    """timm's classifier head (`get_classifier`), None for a model without one."""
    return model.get_classifier() if hasattr(model, "get_classifier") else None


@dataclass(frozen=True)
class Weights:
    model: nn.Module  # on the CPU
    kind: str  # CHECKPOINT, EXPORT or PUBLISHED
    read: str  # the file, folder or timm name read (a run's checkpoints folder: its best.pt)
    source: str  # what the weights are and where they came from, in words
    class_names: Optional[tuple[str, ...]]  # a checkpoint's classes, an export's label_names; None where unsaid
    settings: Optional[dict[str, Any]]  # a checkpoint's run's settings (how it validated)
    val_print: Optional[dict[str, Any]]  # a checkpoint's fingerprint of its run's validation split

    @property
    def classes(self) -> int:
        """The classifier's outputs; 0 for a model without one (a feature extractor)."""
        return getattr(self.model, "num_classes", 0) if classifier(self.model) is not None else 0


def resolve(spec: str, flag: str) -> tuple[str, str]:
    """What `spec` is (CHECKPOINT, EXPORT as timm's `local-dir:`, PUBLISHED) and what to read, told apart by form, then
    on disk, as timm's reader factory does; what is none of these is one line saying every reading tried."""
    if os.path.isdir(spec):  # first: a folder may be called last.pt
        if os.path.isfile(os.path.join(spec, "config.json")):
            return EXPORT, spec
        if os.path.isfile(os.path.join(spec, store.BEST)):
            return CHECKPOINT, os.path.join(spec, store.BEST)
        raise UserError(f"{flag} {spec}: a folder with neither config.json (an export: imagenet-elastic export) nor "
                        f"{store.BEST} (a run's checkpoints folder)")
    if spec.endswith(".pt") or os.path.isfile(spec):
        return CHECKPOINT, spec
    if not spec.startswith(WEIGHT_SOURCES):
        import timm

        tiny_models.register()
        if os.sep in spec or not timm.is_model(spec):
            where = "no such file or folder" + ("" if os.sep in spec else ", and no model timm knows by that name")
            raise UserError(f"{flag} {spec}: {where}")
    return PUBLISHED, spec


def load_weights(spec: str, flag: str, ema: bool = False, published: bool = True) -> Weights:
    """The whole model `spec` names (`resolve`), on the CPU; `ema`: a checkpoint's weight average; `published`:
    whether a timm name's published weights may be read (`evaluate` asks for --pretrained first)."""
    kind, target = resolve(spec, flag)
    if kind == CHECKPOINT:
        try:
            snapshot = store.load(target)
        except UserError as error:
            raise UserError(f"{flag}: {error}") from None
        model = saved_model(snapshot, target, ema)  # first: its one-line refusals of a file that is not ours
        step = f" after step {snapshot['step']}" if "step" in snapshot else ""
        source = f"our checkpoint of {snapshot['model_name']}, its {'weight average' if ema else 'raw weights'}{step}"
        return Weights(model, CHECKPOINT, target, source, tuple(snapshot["classes"]), snapshot.get("config", {}),
                       (snapshot.get("data") or {}).get("val"))
    if kind == PUBLISHED and not published:
        raise UserError(f"{flag} {spec} is a timm model name: reading its published weights needs --pretrained")
    if ema:
        raise UserError(f"--ema applies to our checkpoints only, not to {flag} {spec}")
    model = published_model(f"local-dir:{target}" if kind == EXPORT else target, flag)
    architecture = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", spec)
    if kind == EXPORT or spec.startswith("local-dir:"):
        config = folder_config(spec.removeprefix("local-dir:"), flag)
        if exported_blurpool(config):
            blur_strided_convs(model)  # an export of a --blurpool run says so, and timm builds no blur: give it back
        return Weights(model, kind, target, f"a folder of {architecture} weights (an export, or timm's save_for_hf)",
                       exported_class_names(config), None, None)
    where = describe_source(model, spec)
    return Weights(model, kind, target,
                   f"published weights of {architecture}" + (f": {where}" if where != spec else ""), None, None, None)


def saved_model(snapshot: dict[str, Any], path: str, ema: bool, instead: str = "use it") -> nn.Module:
    """A checkpoint's model built as its run built it (its blur, its size), with its raw weights or (`ema`) their
    average; `instead`: what to do without an average. A file edited or not ours is one line naming it."""
    key = "model_ema" if ema else "model"
    weights = snapshot.get(key)
    if weights is None:
        raise UserError(f"checkpoint {path} has no weight average (it was trained without --model-ema): {instead} "
                        "without --ema" if ema else f"checkpoint {path} holds no model weights")
    lacking = [name for name, kind in (("model_name", str), ("classes", (list, tuple)))
               if not isinstance(snapshot.get(name), kind)]
    if lacking:
        raise UserError(f"checkpoint {path} has no valid {' or '.join(lacking)}: it is not a checkpoint of "
                        "imagenet_elastic, or was edited")
    name, settings = snapshot["model_name"], snapshot.get("config", {})
    check_model_name(name, f"checkpoint {path}'s model {name!r}")
    model = create_model(name, len(snapshot["classes"]), blurpool=saved_setting(settings, "blurpool"),
                         sizes=saved_sizes(settings))
    load_fitting(model, weights, f"checkpoint {path}: its {key!r} weights", name)
    return model


def load_fitting(model: nn.Module, weights: Any, what: str, model_name: str) -> None:
    """`weights` into `model`, or one line saying where `what` does not fit it (not torch's list of all keys)."""
    if not isinstance(weights, dict):
        raise UserError(f"{what} are not a state dict but {type(weights).__name__}")
    problems = misfits(model.state_dict(), weights)
    if problems:
        raise UserError(f"{what} do not fit model {model_name}: {'; '.join(problems)}")
    model.load_state_dict(weights)


def misfits(own: dict[str, Any], weights: dict[str, Any], exempt: frozenset[str] = frozenset()) -> list[str]:
    """Why `weights` misfit a model whose state dict is `own` (`exempt`: names whose shape may differ); [] if none."""
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    misfit = sorted(k for k in set(own) & set(weights)
                    if getattr(own[k], "shape", None) != getattr(weights[k], "shape", None) and k not in exempt)
    return [f"{label} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" for label, keys in
            (("missing", missing), ("unexpected", unexpected), ("other shape", misfit)) if keys]


def folder_config(folder: str, flag: str) -> dict[str, Any]:
    """A folder's config.json (an export's, or timm's save_for_hf's), {} where it has none (timm says so); one that
    is not a JSON object is a UserError naming it, not timm's JSONDecodeError."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{flag} {folder}: {path} cannot be read as JSON "
                        f"({getattr(error, 'strerror', None) or first_line(error)[:200]})") from None
    if not isinstance(config, dict):
        raise UserError(f"{flag} {folder}: {path} is not a JSON object")
    if not isinstance(config.get("architecture"), str):  # a transformers folder has `architectures`
        raise UserError(f"{flag} {folder}: {path} names no timm `architecture` (not a timm or exported model)")
    check_class_count(folder, config, flag)
    return config


def check_class_count(folder: str, config: dict[str, Any], flag: str) -> None:
    """timm builds a folder's classifier for config.json's num_classes (model_args') and, where its weights' count
    (num_classes) differs, drops the weights' classifier for a random one without a word: a config.json whose counts
    are not those of model.safetensors' classifier (edited by hand) is refused instead."""
    path, cfg = os.path.join(folder, "model.safetensors"), config.get("pretrained_cfg") or {}
    head = cfg.get("classifier")
    head = head[0] if isinstance(head, (list, tuple)) and head else head  # DeiT's two heads have one count
    if not isinstance(head, str) or not os.path.isfile(path):
        return
    from safetensors import SafetensorError, safe_open  # timm's dependency

    try:
        with safe_open(path, "pt") as weights:
            names = set(weights.keys())
            # none: a feature extractor's (num_classes 0)
            rows = weights.get_slice(f"{head}.weight").get_shape()[0] if f"{head}.weight" in names else 0
    except (OSError, SafetensorError):
        return  # a damaged file: named as timm reads it (published_model)
    said = {"num_classes": config.get("num_classes", cfg.get("num_classes")),
            "model_args.num_classes": (config.get("model_args") or {}).get("num_classes")}
    for key, count in said.items():
        if count is not None and count != rows:
            raise UserError(f"{flag} {folder}: config.json's {key} is {count}, but the classifier in {path} has "
                            f"{rows} outputs (config.json edited against its weights?)")


def exported_class_names(config: dict[str, Any]) -> Optional[tuple[str, ...]]:
    """Each output's class from config.json's `label_names` (a list, or index -> name), or None."""
    names = config.get("label_names")
    if isinstance(names, dict):
        by_index = {str(k): v for k, v in names.items()}
        names = [by_index[str(i)] for i in range(len(by_index))] if all(
            str(i) in by_index for i in range(len(by_index))) else None
    return tuple(str(n) for n in names) if isinstance(names, (list, tuple)) and names else None


def exported_blurpool(config: dict[str, Any]) -> bool:
    """Whether config.json says its weights were trained with --blurpool (an export of ours; timm builds no blur)."""
    return isinstance(config.get("imagenet_elastic"), dict) and bool(config["imagenet_elastic"].get("blurpool"))


def published_model(model_name: str, flag: str = "--pretrained") -> nn.Module:
    """timm's `model_name` with its published weights on the CPU, or a UserError naming `flag`, the model, the cache."""
    import timm
    from huggingface_hub import constants, errors
    from safetensors import SafetensorError  # timm's dependency

    tiny_models.register()  # an export of a run that trained one names it in its config.json
    named = f"--pretrained --model {model_name}" if flag == "--pretrained" else f"{flag} {model_name}"
    folder = model_name.removeprefix("local-dir:") if model_name.startswith("local-dir:") else None
    if folder is not None:
        folder_config(folder, flag)  # a damaged config.json: named here, not timm's JSONDecodeError
    try:
        return timm.create_model(model_name, pretrained=True)
    except SafetensorError as error:  # a weights file cut short or overwritten
        where = (os.path.join(folder, "model.safetensors") if folder is not None
                 else f"its file in the Hugging Face cache {constants.HF_HUB_CACHE}")
        raise UserError(f"{named}: {where} is damaged ({first_line(error)[:200]})") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached")
        raise UserError(f"{flag}: the weights of {model_name} are not in the Hugging Face cache "
                        f"{constants.HF_HUB_CACHE} and {why}: download them once where the hub can be reached (run "
                        f"with {flag}, or `hf download`), or set HF_HOME to the cache that holds them") from None
    except errors.GatedRepoError:
        raise UserError(f"{flag}: the weights of {model_name} are gated on the hub: accept their terms and "
                        "log in (`hf auth login`) where the run downloads them") from None
    except (errors.RepositoryNotFoundError, errors.EntryNotFoundError):
        raise UserError(f"{flag}: the hub has no weights for {model_name}") from None
    except errors.HfHubHTTPError as error:
        raise UserError(f"{flag} {model_name}: the hub answered {first_line(error)[:200]}") from None
    except FileNotFoundError as error:  # local-dir: without config.json
        where_named = f"--model {model_name}" if flag == "--pretrained" else named
        raise UserError(f"{where_named}: {first_line(error)[:200]}") from None
    # an unknown tag, an architecture without published weights, a file that misfits or that a URL (torch hub) gave
    except (RuntimeError, OSError, ValueError) as error:  # ValueError: a malformed hub name (HFValidationError)
        raise UserError(f"{named}: {first_line(error)[:300]}") from None


def describe_source(model: nn.Module, model_name: str) -> str:
    """Where timm took a model's published weights from: a hub repository (in the cache), a file, or the name."""
    from huggingface_hub import constants

    cfg = getattr(model, "pretrained_cfg", {}) or {}
    source = cfg.get("hf_hub_id") or cfg.get("file") or model_name
    return f"{source} (the Hugging Face cache {constants.HF_HUB_CACHE})" if cfg.get("hf_hub_id") else source


def fetch_published(model_name: str) -> Weights:
    """--pretrained: the published weights of --model; create_model builds the run's model from them."""
    model = published_model(model_name)
    return Weights(model, PUBLISHED, model_name, describe_source(model, model_name), None, None, None)


def describe_published(published: Weights, classes: int) -> str:
    """What the start-up table says of a fresh run's weights."""
    if published.classes == classes:
        return f"published: {published.source}"
    if published.classes == 0:  # a feature extractor: there was no classifier to re-initialise
        return f"published: {published.source} (headless: a new classifier for {classes} classes)"
    return f"published: {published.source} (classifier re-initialised: {published.classes} classes there, " \
           f"{classes} here)"


def unread_file(path: str, error: Exception) -> str:
    """Why a weights file could not be read, in our words where checkpoint/store.py's look at its zip directory tells
    (torch says "101" or "pop from empty list"); a whole pickled model: torch's line naming the class it refused."""
    refused = next((line.strip() for line in str(error).splitlines() if "Unsupported global" in line), None)
    if refused is not None or path.endswith(".safetensors"):
        return (refused or first_line(error))[:200]
    return store.damage(path) or "its content cannot be read back"


class InitialWeights(NamedTuple):
    """--initial-checkpoint's tensors by name: ours, a state dict as timm and torchvision save one, or a safetensors."""

    tensors: dict[str, torch.Tensor]
    blurpool: Optional[bool]  # whether a checkpoint of ours was trained with --blurpool; None: another kind of file
    classes: Optional[tuple[str, ...]] = None  # a checkpoint of ours: its classifier's class names, in order

    @classmethod
    def read(cls, path: str) -> InitialWeights:
        """The tensors of a file, or of the folders --teacher takes: a run's checkpoints folder (its best.pt) or an
        export folder (its weights, and its classes and blur from config.json); what holds none is a UserError."""
        if not os.path.isdir(path):
            return cls.read_file(path)
        kind, target = resolve(path, "--initial-checkpoint")
        if kind == CHECKPOINT:
            return cls.read_file(target)
        config = folder_config(target, "--initial-checkpoint")
        files = [os.path.join(target, name) for name in ("model.safetensors", "pytorch_model.bin")]  # timm's
        weights = cls.read_file(next((file for file in files if os.path.isfile(file)), files[0]))
        return cls(weights.tensors, exported_blurpool(config), exported_class_names(config))

    @classmethod
    def read_file(cls, path: str) -> InitialWeights:
        """The file's tensors; a file that holds none is a UserError naming it."""
        try:
            if path.endswith(".safetensors"):
                from safetensors.torch import load_file  # timm's dependency

                loaded: Any = load_file(path)
            else:
                with torch.serialization.safe_globals([argparse.Namespace]):  # timm's train.py saves its args too
                    loaded = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise UserError(f"--initial-checkpoint {path}: no such file") from None
        except OSError as error:
            raise UserError(f"--initial-checkpoint {path}: {error.strerror or error}") from None
        except Exception as error:  # a parser fed bytes that are not its format fails in any way it likes
            raise UserError(f"--initial-checkpoint {path} is not a checkpoint or state dict: "
                            f"{unread_file(path, error)}") from None
        ours = isinstance(loaded, dict) and "model_name" in loaded
        settings = loaded.get("config") if ours else None
        classes = tuple(loaded["classes"]) if ours and isinstance(loaded.get("classes"), (list, tuple)) else None
        if isinstance(loaded, dict):  # ours, Lightning-style, common scripts
            loaded = next((loaded[key] for key in ("model", "state_dict", "model_state_dict")
                           if isinstance(loaded.get(key), dict)), loaded)
        if not isinstance(loaded, dict) or not loaded or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise UserError(f"--initial-checkpoint {path} holds no state dict of tensors")
        # DDP's `module.` and torch.compile's `_orig_mod.` prefixes, as saved from a wrapped model
        return cls({re.sub(r"^(module\.)*(_orig_mod\.)*", "", name): tensor for name, tensor in loaded.items()},
                   saved_setting(settings, "blurpool") if isinstance(settings, dict) else None, classes)

    def load(self, model: nn.Module, path: str, model_name: str, classes: Optional[tuple[str, ...]] = None) -> str:
        """Copy the weights into `model`; returns what the start-up table says of them. The classifier is kept only
        for as many classes, named alike where both name them (the data's `classes`), else it is re-initialised (its
        rows are other classes'); any other misfit means another model's file, refused."""
        weights, own, head = self.tensors, model.state_dict(), classifier(model)
        prefix = next((name for name, module in model.named_modules() if head is not None and module is head), None)
        head_names = set() if prefix is None else {f"{prefix}.{n}" if prefix else n for n in head.state_dict()}
        problems = misfits(own, weights, frozenset(head_names))
        if problems:
            raise UserError(f"--initial-checkpoint {path} does not fit --model {model_name}: {'; '.join(problems)}")
        refit = sorted(k for k in head_names if own[k].shape != weights[k].shape)
        renamed = not refit and None not in (self.classes, classes) and self.classes != classes and not any(
            names == tuple(map(str, range(len(names)))) for names in (self.classes, classes))  # numbers: unnamed
        if renamed:
            refit = sorted(head_names)
        model.load_state_dict({k: v for k, v in weights.items() if k not in refit}, strict=False)
        if not refit:
            return path
        if renamed:
            there, here = next((a, b) for a, b in zip(self.classes, classes) if a != b)
            return f"{path} (classifier re-initialised: its classes are others: {there!r} there, {here!r} here)"
        return f"{path} (classifier re-initialised: {weights[refit[0]].shape[0]} classes there, " \
               f"{own[refit[0]].shape[0]} here)"

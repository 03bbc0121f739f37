"""--initial-checkpoint: a fresh run's model starts from weights on disk (fine-tuning).

Accepted: our checkpoints, a plain state dict as timm and torchvision save it (also under `state_dict` or `model`,
with `module.` or `_orig_mod.` prefixes), or a `.safetensors` file. A classifier that misfits the class count keeps
its fresh initialisation; any other mismatch means another model's file: refused."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from imagenet_elastic.config import saved_setting
from imagenet_elastic.errors import UserError, first_line

PREFIXES = ("module.", "_orig_mod.")


class InitialWeights(NamedTuple):
    tensors: dict[str, torch.Tensor]
    blurpool: Optional[bool]  # whether a checkpoint of ours was trained with --blurpool; None: another kind of file


def read(path: str) -> InitialWeights:
    """The file's tensors by name; a file that holds none is a UserError naming it."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file  # timm's dependency

            loaded: Any = load_file(path)
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--initial-checkpoint {path}: no such file") from None
    except OSError as error:
        raise UserError(f"--initial-checkpoint {path}: {error.strerror or error}") from None
    except Exception as error:  # a parser fed bytes that are not its format fails in any way it likes
        raise UserError(f"--initial-checkpoint {path} is not a checkpoint or state dict "
                        f"({first_line(error)[:200]})") from None
    settings = loaded.get("config") if isinstance(loaded, dict) and "model_name" in loaded else None  # ours
    for key in ("model", "state_dict", "model_state_dict"):  # ours, Lightning-style, common scripts
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
            break
    if not isinstance(loaded, dict) or not loaded or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise UserError(f"--initial-checkpoint {path} holds no state dict of tensors")
    return InitialWeights({strip_prefixes(name): tensor for name, tensor in loaded.items()},
                          saved_setting(settings, "blurpool") if isinstance(settings, dict) else None)


def strip_prefixes(name: str) -> str:
    for prefix in PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def classifier_names(model: nn.Module) -> set[str]:
    """The state dict names of timm's classifier head (`get_classifier`), empty for a model without one."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    for prefix, module in model.named_modules():
        if head is not None and module is head:
            return {f"{prefix}.{name}" if prefix else name for name in module.state_dict()}
    return set()


def load(model: nn.Module, initial: InitialWeights, path: str, model_name: str) -> str:
    """Copy the weights into `model`; returns what the start-up table says of them."""
    weights = initial.tensors
    own = model.state_dict()
    head = classifier_names(model)
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    misfit = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape and k not in head)
    if missing or unexpected or misfit:
        problems = [f"{label} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                    for label, keys in (("missing", missing), ("unexpected", unexpected), ("other shape", misfit))
                    if keys]
        raise UserError(f"--initial-checkpoint {path} does not fit --model {model_name}: {'; '.join(problems)}")
    refit = sorted(k for k in head if own[k].shape != weights[k].shape)
    model.load_state_dict({k: v for k, v in weights.items() if k not in refit}, strict=False)
    if not refit:
        return path
    classes = next(weights[k].shape[0] for k in refit)
    return f"{path} (classifier re-initialised: {classes} classes there, {own[refit[0]].shape[0]} here)"

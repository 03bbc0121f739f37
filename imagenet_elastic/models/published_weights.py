"""--pretrained: a fresh run's model starts from the weights timm publishes for --model (fine-tuning).

timm resolves the name (`resnet50`: its default tag; `resnet50.a1_in1k`; `hf-hub:ORG/NAME`; `local-dir:FOLDER` as
`imagenet-elastic export` writes it) through the Hugging Face hub cache (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE), so
an offline node reads what an earlier download left. Read once at the start (`fetch`), before any data scan, so a
missing file costs seconds; timm's own loader then builds the model from them (`timm_options`), re-initialising a
classifier of another class count. Ranks sharing a cache download once (huggingface_hub locks a download)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from imagenet_elastic.errors import UserError, first_line
from imagenet_elastic.models import tiny_models

if TYPE_CHECKING:
    import torch
    from torch import nn


class Published(NamedTuple):
    tensors: dict[str, torch.Tensor]
    source: str  # where they came from, for the start-up table
    classes: int  # the classifier's class count there


def cache_folder() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def fetch(model_name: str) -> Published:
    """The published weights of `model_name` as timm loads them, or a UserError naming the model and the cache."""
    model = create(model_name)
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    classes = getattr(model, "num_classes", 0) if head is not None else 0
    return Published(model.state_dict(), describe_source(model, model_name), classes)


def create(model_name: str, flag: str = "--pretrained") -> nn.Module:
    """timm's model `model_name` with its published weights (on the CPU), or a UserError naming `flag` (the option
    that asked: --pretrained, --teacher), the model and the cache."""
    import timm
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    tiny_models.register()  # an export of a run that trained one names it in its config.json
    where = f"the Hugging Face cache {cache_folder()}"
    named = f"--pretrained --model {model_name}" if flag == "--pretrained" else f"{flag} {model_name}"
    try:
        return timm.create_model(model_name, pretrained=True)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached")
        raise UserError(f"{flag}: the weights of {model_name} are not in {where} and {why}: download them "
                        f"once where the hub can be reached (run with {flag}, or `hf download`), or set "
                        "HF_HOME to the cache that holds them") from None
    except GatedRepoError:
        raise UserError(f"{flag}: the weights of {model_name} are gated on the hub: accept their terms and "
                        "log in (`hf auth login`) where the run downloads them") from None
    except (RepositoryNotFoundError, EntryNotFoundError):
        raise UserError(f"{flag}: the hub has no weights for {model_name}") from None
    except HfHubHTTPError as error:
        raise UserError(f"{flag} {model_name}: the hub answered {first_line(error)[:200]}") from None
    except FileNotFoundError as error:  # local-dir: without config.json
        where_named = f"--model {model_name}" if flag == "--pretrained" else named
        raise UserError(f"{where_named}: {first_line(error)[:200]}") from None
    except RuntimeError as error:  # an unknown tag, an architecture without published weights, a file that misfits
        raise UserError(f"{named}: {first_line(error)[:300]}") from None
    except OSError as error:  # weights timm downloads from a URL (torch hub's cache), a file it cannot read
        raise UserError(f"{named}: {first_line(error)[:300]}") from None


def describe_source(model: nn.Module, model_name: str) -> str:
    """Where timm took a model's published weights from: a hub repository (in the cache), a file, or the name."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    source = cfg.get("hf_hub_id") or cfg.get("file") or model_name
    return f"{source} (the Hugging Face cache {cache_folder()})" if cfg.get("hf_hub_id") else source


def timm_options(published: Published) -> dict[str, Any]:
    """timm.create_model's arguments that load these weights: its pretrained path with the tensors in hand
    (a `state_dict` source), so nothing is read twice and timm still drops a classifier of another class count."""
    return {"pretrained": True, "pretrained_cfg_overlay": {"source": "", "state_dict": published.tensors,
                                                           "num_classes": published.classes}}


def describe(published: Published, classes: int) -> str:
    """What the start-up table says of a fresh run's weights."""
    if published.classes == classes:
        return f"published: {published.source}"
    if published.classes == 0:  # a feature extractor: there was no classifier to re-initialise
        return f"published: {published.source} (headless: a new classifier for {classes} classes)"
    return f"published: {published.source} (classifier re-initialised: {published.classes} classes there, " \
           f"{classes} here)"

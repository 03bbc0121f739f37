"""Everything a run needs to continue exactly: captured to and applied from plain dicts."""

from __future__ import annotations

import dataclasses
import os
import random
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from imagenet_elastic.config import saved_setting, yaml_file
from imagenet_elastic.errors import UserError, one_line
from imagenet_elastic.launch import distributed

FORMAT_VERSION = 2  # 2: mid-epoch progress (`epoch_progress`)


def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": [list(s) if isinstance(s, tuple) else s for s in random.getstate()],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),  # plain for the pickle
                      *(v.item() if isinstance(v, np.generic) else v for v in np_state[2:])]}


def apply_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


@dataclass
class EpochTally:
    """How far into the current epoch training got, in terms that do not depend on the world size."""

    samples: int = 0  # global samples consumed: where the sampler continues
    steps: int = 0
    loss_sum: float = 0.0  # sum over steps of the step's mean loss over all ranks
    seconds: float = 0.0  # training time, for the epoch's images/s
    parts: dict[str, float] = field(default_factory=dict)  # the loss's parts' sums, by name

    def add(self, other: EpochTally) -> None:
        self.samples += other.samples
        self.steps += other.steps
        self.loss_sum += other.loss_sum
        self.seconds += other.seconds
        for name, value in other.parts.items():
            self.parts[name] = self.parts.get(name, 0.0) + value


class PendingSteps:
    """Steps trained since the tally's last update; their losses and parts stay on the device."""

    def __init__(self, device: torch.device, parts: tuple[str, ...] = ()) -> None:
        self.names = parts
        self.loss = torch.zeros(1 + len(parts), dtype=torch.float64, device=device)  # partial sums add up the same
        self.steps, self.start = 0, time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def fold_into(self, tally: EpochTally, global_batch: int, world_size: int) -> EpochTally:
        """One all-reduce: each step's loss (and parts) averaged over ranks, summed over the pending steps; returns
        what was added. With none pending nothing is sent: all ranks trained the same steps, so all skip alike."""
        if not self.steps:
            return EpochTally()
        loss_sum, *parts = (value / world_size for value in distributed.all_reduce_sum(self.loss.clone()).tolist())
        added = EpochTally(self.steps * global_batch, self.steps, loss_sum, time.perf_counter() - self.start,
                           dict(zip(self.names, parts)))
        tally.add(added)
        self.loss.zero_()
        self.steps, self.start = 0, time.perf_counter()
        return added


@dataclass
class TrainState:
    """The mutable part of training. `capture` and `apply` are exact inverses."""

    model: nn.Module  # unwrapped (not the DDP wrapper)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    epoch: int = 0  # completed epochs
    step: int = 0  # optimizer steps taken, the LR schedule's position
    best_top1: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)  # one metrics row per completed epoch
    tally: EpochTally = field(default_factory=EpochTally)  # the epoch in progress
    ema: Optional[nn.Module] = None  # --model-ema: timm's ModelEmaV3, whose `module` is the averaged model

    def update_average(self, every: int) -> None:
        """After optimizer step `self.step`: the weight average takes the weights every `every` steps, a function of
        the step alone, so a resume at any step and world size averages the same; timm's warmup counts its updates."""
        if self.ema is not None and self.step % every == 0:
            self.ema.update(self.model, step=self.step // every)

    def capture(self, config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "model": self.model.state_dict(),
                "model_ema": self.ema.module.state_dict() if self.ema is not None else None,
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "epoch": self.epoch,
                "step": self.step, "best_top1": self.best_top1, "history": self.history,
                "epoch_progress": dataclasses.asdict(self.tally), "rng": capture_rng(), "config": config,
                "saved_at": time.time(), **meta}

    def apply(self, snapshot: dict[str, Any]) -> None:
        self.model.load_state_dict(snapshot["model"])
        if self.ema is not None:  # a checkpoint without an average starts it from its weights
            self.ema.module.load_state_dict(snapshot.get("model_ema") or snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])  # its own kernels and layout: optimizer.py
        if snapshot["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(snapshot["scaler"])
        self.epoch, self.step, self.best_top1 = snapshot["epoch"], snapshot["step"], snapshot["best_top1"]
        self.history = list(snapshot["history"])
        self.tally = EpochTally(**(snapshot.get("epoch_progress") or {}))  # absent or None: the epoch's start
        apply_rng(snapshot["rng"])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dict_or_none(value: Any) -> bool:
    return value is None or isinstance(value, dict)


# What `TrainState.apply` and the build read from a checkpoint, each with what it must be (None: the key is absent)
RESUMED: dict[str, Callable[[Any], bool]] = {
    "model": lambda v: isinstance(v, dict), "optimizer": lambda v: isinstance(v, dict), "scaler": _dict_or_none,
    "model_ema": _dict_or_none, "epoch": _count, "step": _count,
    "best_top1": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "history": lambda v: isinstance(v, list) and all(isinstance(row, dict) for row in v),
    "epoch_progress": lambda v: v is None or isinstance(v, dict) and v.keys() <= EpochTally.__dataclass_fields__.keys()
    and _count(v.get("samples", 0)) and _count(v.get("steps", 0)),
    "rng": lambda v: isinstance(v, dict) and {"torch", "python", "numpy"} <= v.keys(),
    "world_size": lambda v: v is None or _count(v) and v > 0,
    "global_batch": lambda v: v is None or _count(v) and v > 0,
}


def check_resumable(snapshot: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint whose state a resume cannot take (hand-edited, or another program's) in one line naming
    the key, before the build reads it."""
    for key, valid in RESUMED.items():
        if not valid(snapshot.get(key)):
            found = repr(snapshot[key])[:60] if key in snapshot else "missing"
            raise UserError(f"checkpoint {path} cannot be resumed: its {key!r} is {found}")
    samples, end = (snapshot.get("epoch_progress") or {}).get("samples", 0), saved_epoch_samples(snapshot)
    if end is not None and samples > end:
        raise UserError(f"checkpoint {path} is damaged: its 'epoch_progress' is {samples} samples into an epoch of "
                        f"{end} samples")


def saved_epoch_samples(snapshot: dict[str, Any]) -> Optional[int]:
    """The samples an epoch of the checkpoint's run held (its data's count, its global batch, its
    --max-steps-per-epoch), past which no checkpoint of it is, whatever this run's are (a larger global batch may
    end the epoch sooner); None where the checkpoint does not keep them."""
    train = (snapshot.get("data") or {}).get("train") or {}
    count, batch = train.get("count"), snapshot.get("global_batch")
    if not (_count(count) and batch):
        return None
    steps = count // batch
    return min(steps, saved_setting(snapshot.get("config", {}), "max_steps_per_epoch") or steps) * batch


def apply_checkpoint(state: TrainState, snapshot: dict[str, Any], path: str) -> None:
    """`state.apply(snapshot)`: weights or optimizer state that do not fit this run's model (a checkpoint edited by
    hand; its model name and classes were checked) said in one line naming the file."""
    try:
        state.apply(snapshot)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"checkpoint {path} does not fit this run's model: {one_line(error)[:200]}") from None


def run_settings(path: str, model_name: str) -> str:
    """The options that use checkpoint `path` of `model_name`: its run's settings file where its folder keeps one
    (the model and whatever else a command line left at its default), else its --model."""
    settings = os.path.join(os.path.dirname(path), yaml_file.FILE_NAME)
    if os.path.isfile(settings):
        return f"--config {shlex.quote(settings)}, its run's settings (or --model {model_name})"
    return f"--model {model_name}"


def check_compatible(snapshot: dict[str, Any], path: str, model_name: str, classes: tuple[str, ...],
                     optimizer: Optional[str] = None, blurpool: bool = False) -> None:
    """Refuse a checkpoint of another model (--blurpool included: its state dict is the plain model's),
    class list or (when training goes on) optimizer before touching any state."""
    version = snapshot.get("format_version", 1)
    if not _count(version) or version > FORMAT_VERSION:
        raise UserError(f"checkpoint {path} has format version {version!r}: this imagenet_elastic reads versions up to "
                        f"{FORMAT_VERSION} (a newer one wrote it?)")
    settings = snapshot.get("config", {})
    if not isinstance(settings, dict):
        raise UserError(f"checkpoint {path} is damaged: its 'config' is not a mapping")
    saved_model = snapshot.get("model_name")
    saved_classes = tuple(snapshot.get("classes", ()))
    if saved_model != model_name:
        raise UserError(f"checkpoint {path} is of model {saved_model!r}, but --model is {model_name!r}: pass "
                        f"{run_settings(path, saved_model)}")
    saved_blurpool = saved_setting(settings, "blurpool")
    if saved_blurpool != blurpool:
        raise UserError(f"checkpoint {path} was trained {'with' if saved_blurpool else 'without'} --blurpool: "
                        f"pass {'--blurpool' if saved_blurpool else '--no-blurpool'} to use it")
    if len(saved_classes) != len(classes):
        raise UserError(f"checkpoint {path} has {len(saved_classes)} classes, the data has {len(classes)}")
    if saved_classes != classes:
        raise UserError(f"checkpoint {path} was trained on other class names than the data's folders")
    trained_with = saved_setting(settings, "opt")
    if optimizer is not None and trained_with != optimizer:
        raise UserError(f"checkpoint {path} was trained with --opt {trained_with}, whose state --opt {optimizer} "
                        f"cannot continue: resume it with --opt {trained_with}")

"""--micro-batch auto's probe: the largest micro-batch whose training step (the run's model, precision, layout and
largest training size; forward, backward and optimizer step, twice) fits the device, halving after each out-of-memory
error. Eager even under --compile: compiling each size would cost minutes, and a compiled step usually keeps fewer
activations, so it errs safe; the step's own halving catches the rest. It leaves no trace (`untouched`): a run that
probed trains the same bits."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Optional

import torch
from torch import nn

from imagenet_elastic.data.model_input import ModelInput, prepare_batch
from imagenet_elastic.train.distillation import Distillation
from imagenet_elastic.train.state import apply_rng, capture_rng
from imagenet_elastic.train.step import micro_batch_loss


def largest_that_fits(fits: Callable[[int], bool], first: int, smaller: Callable[[int], Optional[int]]
                      ) -> Optional[int]:
    """The first size from `first` down (`smaller(size)`; None: no smaller) for which `fits` holds, or None."""
    size: Optional[int] = first
    while size is not None and not fits(size):
        size = smaller(size)
    return size


def step_fits(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: nn.Module, to: ModelInput,
              size: int, image_size: int, distillation: Optional[Distillation] = None) -> bool:
    """Whether two steps (and teacher forwards) of `size` images of `image_size` px fit; call inside `untouched`."""
    fitted = False
    try:
        trial(model, optimizer, criterion, to, size, image_size, distillation)
        fitted = True
    except torch.OutOfMemoryError:
        pass  # the trial's tensors go with its frames, when this handler ends
    optimizer.zero_grad(set_to_none=True)
    release_cached_memory(to.device)
    return fitted


def trial(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: nn.Module, to: ModelInput, size: int,
          image_size: int, distillation: Optional[Distillation] = None) -> None:
    images = torch.zeros((size, image_size, image_size, 3), dtype=torch.uint8, device=to.device)
    labels = torch.zeros(size, dtype=torch.int64, device=to.device)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for _ in range(2):  # the second forward and backward beside the optimizer's state and the first's gradients,
        inputs, targets = prepare_batch(images, labels, to)  # as a later micro-batch of an accumulating step
        with to.autocast():
            loss, _ = micro_batch_loss(model, criterion, distillation, inputs, targets)
        loss.backward()
        del inputs, loss
        optimizer.step()


def release_cached_memory(device: torch.device) -> None:
    """What an out-of-memory error left cached goes back to the device, so the next, smaller try starts unfragmented."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def untouched(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Whatever runs inside changes nothing that outlives it: parameters, buffers, gradients, train/eval flags,
    optimizer state and settings, random generators are put back in place (DDP and the optimizer hold references)."""
    tensors = list(model.parameters()) + list(model.buffers())
    kept = [t.detach().to("cpu", copy=True) for t in tensors]
    grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
    flags = [m.training for m in model.modules()]
    state = optimizer_snapshot(optimizer)
    rng = capture_rng()
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, kept):
                tensor.copy_(value)
            for param, grad in zip(model.parameters(), grads):
                param.grad = None if grad is None else grad.to(param.device)
        for module, flag in zip(model.modules(), flags):
            module.training = flag
        optimizer_restore(optimizer, state)
        apply_rng(rng)


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """The optimizer's state tensors, each beside a host copy of its values (None and a copy for a value that is not
    a tensor), and the group settings (timm's LAMB counts steps in the group)."""
    state = {param: {key: (value, value.detach().to("cpu", copy=True)) if isinstance(value, torch.Tensor)
                     else (None, copy.deepcopy(value)) for key, value in entries.items()}
             for param, entries in optimizer.state.items()}
    groups = [{key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
              for group in optimizer.param_groups]
    return state, groups


def optimizer_restore(optimizer: torch.optim.Optimizer, snapshot: tuple[dict, list[dict]]) -> None:
    """The snapshot's values written back into the very tensors it was taken from (layout, device and identity kept);
    state made since is dropped. The host copies are only read: they may be written back again."""
    state, groups = snapshot
    for param in [p for p in optimizer.state if p not in state]:
        del optimizer.state[param]
    for param, saved in state.items():
        entries = optimizer.state[param]
        entries.clear()
        with torch.no_grad():
            for key, (tensor, value) in saved.items():
                entries[key] = copy.deepcopy(value) if tensor is None else tensor.copy_(value)
    for group, saved_group in zip(optimizer.param_groups, groups):
        for key in [k for k in group if k != "params" and k not in saved_group]:
            del group[key]
        group.update(saved_group)


def probe(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: nn.Module, to: ModelInput, image_size: int,
          first: int, smaller: Callable[[int], Optional[int]], distillation: Optional[Distillation] = None
          ) -> Optional[int]:
    """The largest micro-batch from `first` down (`smaller`) whose training step fits, or None; leaves no trace."""
    with untouched(model, optimizer):
        return largest_that_fits(lambda size: step_fits(model, optimizer, criterion, to, size, image_size,
                                                        distillation), first, smaller)

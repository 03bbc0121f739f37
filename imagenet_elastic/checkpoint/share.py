"""Load once: rank 0 reads the checkpoint and the other ranks receive it over the process group, rather than all
reading the network file system at every restart, when it is busiest; the others map it (`load(lazy=True)`) for the
few KB they need before the process group exists. The result is `load`'s down to dtypes, strides and bits: a
channels_last momentum buffer received as NCHW fails CUDA's fused SGD at the first step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from imagenet_elastic.checkpoint.store import map_tree
from imagenet_elastic.launch import distributed

ALIGN = 64  # each tensor's bytes start at a multiple of this, so a byte view can become any dtype


@dataclass(frozen=True)
class Slot:
    """Where a tensor lies in the byte buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: Optional[tuple[int, ...]] = None  # a dense layout to rebuild (channels_last, ...); None: contiguous


def dense_layout(tensor: torch.Tensor) -> bool:
    """Whether the tensor fills its storage span once, in some order of its dimensions: `empty_strided` rebuilds it."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(tensor.shape, tensor.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def pack(tree: Any) -> tuple[Any, torch.Tensor]:
    """`tree` with each tensor replaced by its Slot, and the buffer holding every tensor's bytes."""
    parts: list[tuple[int, torch.Tensor]] = []  # each tensor's offset and bytes
    size = 0

    def slot(value: torch.Tensor, _: tuple) -> Slot:
        nonlocal size
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # in logical order
        parts.append((size, data))
        slot = Slot(size, value.dtype, tuple(value.shape),
                    None if value.is_contiguous() or not dense_layout(value) else tuple(value.stride()))
        size += -(-data.numel() // ALIGN) * ALIGN
        return slot

    skeleton = map_tree(slot, tree)
    buffer = torch.empty(size, dtype=torch.uint8)
    for offset, data in parts:
        buffer[offset:offset + data.numel()] = data
    return skeleton, buffer


def unpack(skeleton: Any, buffer: torch.Tensor) -> Any:
    """The inverse of `pack`. Each tensor gets its own storage, as from torch.load: an optimizer keeps the state
    tensors it is given, and torch.save refuses tensors of several dtypes that share one."""
    def tensor(slot: Slot, _: tuple) -> torch.Tensor:
        data = buffer[slot.offset:slot.offset + math.prod(slot.shape) * slot.dtype.itemsize]
        data = data.view(slot.dtype).reshape(slot.shape)
        if slot.stride is None:
            return data.clone()
        return torch.empty_strided(slot.shape, slot.stride, dtype=slot.dtype).copy_(data)

    return map_tree(tensor, skeleton, Slot)


def from_main(tree: Optional[Any], device: torch.device) -> Any:
    """Rank 0's `tree` on every rank (others pass None), via `device`: the group's (NCCL: GPU, gloo: CPU)."""
    if not distributed.is_initialized():
        return tree
    skeleton, buffer = pack(tree) if dist.get_rank() == 0 else (None, None)
    skeleton, size = distributed.broadcast_object((skeleton, None if buffer is None else buffer.numel()), src=0)
    on_device = buffer.to(device) if buffer is not None else torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(on_device, src=0)
    return tree if dist.get_rank() == 0 else unpack(skeleton, on_device.cpu())

"""Crop, resize and flip a whole batch of decoded images of different sizes in a fixed number of operators: an
antialiased resize is separable, so an image's crop, resize and flip are two small matrices (output x input pixels,
zero outside the crop, reversed for a flip), and the batch is two batched matrix products over the images padded into
one canvas. The weights are PyTorch's own for `interpolate(..., antialias=True)`: the float resize's pixels within
float32 rounding, and within one level of the CPU path's uint8 kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from imagenet_elastic.data.pixels import Box, CentreCrop, pixel_span

SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}  # half the filter's width at scale 1 (PyTorch's interp_size / 2)
CUBIC_A = -0.5  # PyTorch's antialiased bicubic filter (Pillow's), not the -0.75 of its plain bicubic
CANVAS_BUDGET = 1 << 28  # float32 pixels of one canvas (1 GiB, as much again for its positions); more: in parts
INT32_POSITIONS = (1 << 31) - 1  # the most image bytes a batch may hold for its canvas's positions to be int32

# An image's view, one row of numbers: for its rows, then its columns, AXIS numbers each (input pixels
# [start, start + length) resized to `full` pixels, of which the output keeps `size` from `offset` on), then the flip.
AXIS = 4  # start, length, full, offset
VIEW_FIELDS = 2 * AXIS + 1


def train_view(box: Box, flip: bool, width: int, height: int, size: int) -> list[float]:
    """A training crop's row: the box's whole pixels (pixels.crop_region's) resized to size x size."""
    left, top, w, h = box
    rows, cols = pixel_span(top, h, height), pixel_span(left, w, width)
    return [rows.start, rows.stop - rows.start, size, 0, cols.start, cols.stop - cols.start, size, 0, float(flip)]


def centre_view(view: CentreCrop, width: int, height: int) -> list[float]:
    """Validation's row: the whole image resized as torchvision resizes it (short side to `view.resize`, the long
    side to int(resize * long / short)), then the centred `view.size` square (offsets as its CenterCrop rounds)."""
    short, long = min(width, height), max(width, height)
    resized_long = int(view.resize * long / short)
    full_h, full_w = (view.resize, resized_long) if height <= width else (resized_long, view.resize)
    top, left = int(round((full_h - view.size) / 2.0)), int(round((full_w - view.size) / 2.0))
    return [0, height, full_h, top, 0, width, full_w, left, 0.0]


def filter_weights(x: torch.Tensor, interpolation: str) -> torch.Tensor:
    """The resampling filter at distance `x` (in filter units)."""
    x = x.abs()
    if interpolation == "bilinear":
        return (1 - x).clamp_(min=0)
    a = CUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def axis_weights(axis: torch.Tensor, size: int, extent: int, interpolation: str) -> torch.Tensor:
    """(N, 4) float32 axis rows -> (N, size, extent) weights: output pixel o of image n is the weighted sum of its
    input pixels 0..extent-1 along this axis. PyTorch's antialiased weights: the filter stretched by the scale
    when shrinking, centred at scale * (o + 0.5), cut to the pixels PyTorch visits, normalised to sum 1."""
    start, length, full, offset = (axis[:, k, None, None] for k in range(AXIS))
    scale = length / full
    stretch = scale.clamp(min=1.0)  # the filter widens only when shrinking
    support, inverse = SUPPORT[interpolation] * stretch, 1 / stretch
    out = torch.arange(size, device=axis.device, dtype=torch.float32)[None, :, None] + offset
    centre = scale * (out + 0.5)
    first = (centre - support + 0.5).floor_().clamp_(min=0)  # int() of a non-negative number
    stop = torch.minimum((centre + support + 0.5).floor_(), length)
    pixel = torch.arange(extent, device=axis.device, dtype=torch.float32)[None, None, :] - start  # in the region
    weights = filter_weights((pixel - centre + 0.5) * inverse, interpolation)
    weights = weights * ((pixel >= first) & (pixel < stop))
    return weights / weights.sum(dim=2, keepdim=True)


def crop_resize(images: Sequence[torch.Tensor], views: torch.Tensor, size: int,
                interpolation: str = "bilinear") -> torch.Tensor:
    """Decoded C x H x W uint8 images (any sizes and dense layouts, one device) and their (N, VIEW_FIELDS) float32
    views -> N x size x size x 3 uint8, contiguous: out[n] = rows[n] @ image[n] @ columns[n]^T as two batched products
    on transposed views of one padded float32 canvas, so the result comes out NHWC with no copy."""
    parts = canvas_parts([tuple(im.shape[-2:]) for im in images], CANVAS_BUDGET)
    if len(parts) > 1:
        return torch.cat([crop_resize(images[s], views[s], size, interpolation) for s in parts])
    height, width = (max(im.shape[axis] for im in images) for axis in (-2, -1))
    canvas = padded_canvas(images, height, width)  # N x C x H x W float32
    n, channels = canvas.shape[:2]
    rows = axis_weights(views[:, :AXIS], size, height, interpolation)
    columns = axis_weights(views[:, AXIS:2 * AXIS], size, width, interpolation)
    columns = torch.where(views[:, 2 * AXIS, None, None] > 0.5, columns.flip(1), columns)  # flipped
    # (N, size_x, W) @ (N, W, C*H) -> (N, size_x, C, H); then (N, size_y, H) @ (N, H, size_x*C) -> N, y, x, C
    across = torch.bmm(columns, canvas.view(n, channels * height, width).transpose(1, 2))
    out = torch.bmm(rows, across.view(n, size * channels, height).transpose(1, 2))
    return out.round_().clamp_(0, 255).to(torch.uint8).view(n, size, size, channels)


def padded_canvas(images: Sequence[torch.Tensor], height: int, width: int) -> torch.Tensor:
    """The images as float32 in one N x C x height x width tensor, each top-left: one gather from all images' bytes as
    they lie, at positions computed on the device from a small pinned table, so the host waits for nothing (a nested
    tensor's `to_padded_tensor` waits on a pageable copy). Past an image's edge the canvas repeats it: the resize
    weights there are zero. Positions are int32 where the batch's bytes allow (half int64's memory)."""
    device, channels = images[0].device, images[0].shape[0]
    pieces, table, total = [], [], 0
    for image in images:
        memory = image.permute(sorted(range(3), key=image.stride, reverse=True))  # its dimensions in memory order
        if not memory.is_contiguous():  # a view with gaps (no decoder's): copied on its own
            image = memory = image.contiguous()
        pieces.append(memory.view(-1))  # its bytes as they lie: a view
        table.append([total, image.shape[1] - 1, image.shape[2] - 1, *image.stride()])
        total += image.numel()
    index_type = torch.int32 if total <= INT32_POSITIONS else torch.int64
    start, last_row, last_column, channel, row, column = to_device(
        torch.tensor(table, dtype=index_type), device).unbind(1)
    rows = torch.arange(height, device=device, dtype=index_type).minimum(last_row[:, None]).mul_(row[:, None])
    columns = torch.arange(width, device=device, dtype=index_type).minimum(last_column[:, None]).mul_(column[:, None])
    planes = torch.arange(channels, device=device, dtype=index_type).mul(channel[:, None]).add_(start[:, None])
    where = (planes[:, :, None] + rows[:, None, :])[..., None] + columns[:, None, None, :]  # N x C x H x W
    flat = torch.cat(pieces).to(torch.float32)
    return flat.index_select(0, where.view(-1)).view(len(images), channels, height, width)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without the host waiting (on CUDA via pinned memory: pageable copies wait)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def canvas_parts(shapes: list[tuple[int, int]], budget: int = CANVAS_BUDGET) -> list[slice]:
    """Consecutive runs of at least one image whose padded canvas (count x 3 x max height x max width) fits."""
    parts, first, top_h, top_w = [], 0, 0, 0
    for i, (h, w) in enumerate(shapes):
        grown_h, grown_w = max(top_h, h), max(top_w, w)
        if i > first and (i - first + 1) * 3 * grown_h * grown_w > budget:
            parts.append(slice(first, i))
            first, grown_h, grown_w = i, h, w
        top_h, top_w = grown_h, grown_w
    parts.append(slice(first, len(shapes)))
    return parts

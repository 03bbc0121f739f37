"""--decode: which process turns a sample's bytes into pixels. The one place that knows both ways.

cpu: loader workers decode, crop, resize and flip, then run the policy and erasing; batches of uint8 pixels
cross to the training process. gpu: workers only parse each image's header and draw its crop; the bytes
cross (one EncodedBatch per batch), and the training process decodes whole batches with nvJPEG, crops them
there and runs the policy and erasing on the device (gpu_decode.BatchDecoder). Validation takes the same two
ways with the reference's view of each image (pixels.CentreCrop) instead of a random crop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from imagenet_elastic.data import gpu_decode, pipeline, pixels
from imagenet_elastic.data.augment import Augment


@dataclass(frozen=True)
class Decoding:
    mode: str  # one of config.DECODE_MODES

    @property
    def load(self) -> pipeline.Load:
        """What a loader worker does with a sample's bytes."""
        return gpu_decode.encode_bytes if self.mode == "gpu" else pixels.decode_bytes

    @property
    def eval_load(self) -> pipeline.EvalLoad:
        """What a validation loader's worker does with a sample's bytes."""
        return gpu_decode.encode_centre_crop if self.mode == "gpu" else pixels.decode_centre_crop

    @property
    def collate(self) -> Callable[[list], pipeline.Batch]:
        """How a worker's samples become one batch."""
        return gpu_decode.collate if self.mode == "gpu" else pipeline.collate

    def finisher(self, device: torch.device, warn: Callable[[str], None],
                 augment: Augment) -> Optional[gpu_decode.BatchDecoder]:
        """What the training process does with a batch before it trains on it (None: nothing)."""
        return gpu_decode.BatchDecoder(device, warn, augment) if self.mode == "gpu" else None

    def warning(self, device: torch.device) -> Optional[str]:
        """What to say at start about this mode on this device."""
        if self.mode == "gpu" and device.type != "cuda":
            return ("--decode gpu without a CUDA device: the main process decodes each batch on the CPU (slower than "
                    "--decode cpu; meant for testing)")
        return None

    def describe(self, device: torch.device, augment: Augment) -> str:
        """The start-up table's line."""
        if self.mode == "cpu":
            return "in loader workers"
        return (f"batched on {device} (--decode gpu)"
                + (", then the policy and erasing there, image by image" if augment.after_crop else ""))

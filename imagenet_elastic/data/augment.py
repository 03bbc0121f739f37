"""What a training sample goes through: the crop and flip it draws, then an optional augmentation policy and random
erasing on its uint8 pixels, torchvision's (transforms.v2): each sample's pass runs under torch's global generator
seeded from one number its own stream draws after its crop and flip, so the pixels are a function of (seed, epoch,
index) alone. Under --decode gpu the worker makes the draws (`Augment.draws`) and the device applies them."""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from imagenet_elastic import options
from imagenet_elastic.errors import UserError
from imagenet_elastic.options import option

if TYPE_CHECKING:  # torch is imported where pixels are touched: the command line checks these settings first
    import torch

# --auto-augment: each policy's name in the start-up table, and how torchvision's transforms.v2 builds it
POLICY_TABLE: dict[str, tuple[str, Callable[[Any], Optional[Callable]]]] = {
    "none": ("", lambda v2: None),
    "ta_wide": ("TrivialAugmentWide", lambda v2: v2.TrivialAugmentWide()),
    "ra": ("RandAugment", lambda v2: v2.RandAugment()),
    "imagenet": ("AutoAugment (ImageNet policy)", lambda v2: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)),
}
POLICIES = tuple(POLICY_TABLE)
MEAN_PIXEL = (124, 116, 104)  # ImageNet's mean in uint8: what normalisation turns into 0, the erased value


@dataclass(frozen=True)
class Draws:
    """What one sample's policy and erasing drew, without their pixels: the operations in the order they run, each
    with its magnitude as torchvision passes it to the operation, and the erased box (None: nothing erased)."""

    ops: tuple[tuple[str, float], ...] = ()
    erase: Optional[tuple[int, int, int, int]] = None  # top, left, height, width


@dataclass(frozen=True)
class Augment:
    """The training augmentation, as the flags set it (defaults: the Inception crop and flip)."""

    scale: tuple[float, float] = (0.08, 1.0)  # crop area, as a fraction of the image
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # crop aspect ratio
    hflip: float = 0.5
    policy: str = "none"
    erase: float = 0.0

    @property
    def after_crop(self) -> bool:
        """Whether the pixels take a second pass (the policy or random erasing) after the crop."""
        return self.policy != "none" or self.erase > 0

    def describe(self) -> str:
        """For the start-up table."""
        policy = POLICY_TABLE[self.policy][0]
        return (f"crop area {self.scale[0]:g}-{self.scale[1]:g}, aspect {self.ratio[0]:.3g}-{self.ratio[1]:.3g}, "
                f"flip {self.hflip:g}" + (f", {policy}" if policy else "")
                + (f", random erasing {self.erase:g}" if self.erase else ""))

    def draw_seed(self, rng: random.Random) -> Optional[int]:
        """The seed of a sample's policy and erasing, drawn after its crop and flip (so a policy keeps every crop)."""
        return rng.getrandbits(63) if self.after_crop else None

    def apply(self, pixels: torch.Tensor, seed: Optional[int], pil: bool = True) -> torch.Tensor:
        """HWC uint8 -> HWC uint8, the policy then erasing, drawn from `seed` (None: unchanged). `pil` (CPU only): the
        policy on a PIL image, faster on a CPU than tensor kernels, its output contiguous; else tensor kernels."""
        if seed is None:  # draw_seed gives None exactly when there is no second pass
            return pixels
        import numpy as np
        import torch
        from PIL import Image

        policy, erasing = self.transforms
        with seeded(seed):
            if policy is not None and pil:
                pixels = torch.from_numpy(np.array(policy(Image.fromarray(pixels.numpy()))))
            elif policy is not None:
                pixels = policy(pixels.permute(2, 0, 1)).permute(1, 2, 0)
            if erasing is not None:
                pixels = erasing(pixels.permute(2, 0, 1)).permute(1, 2, 0)
        return pixels.contiguous() if pil else pixels

    def draws(self, seed: Optional[int], size: int) -> Optional[Draws]:
        """The draws `apply(pixels, seed)` makes on a size x size crop (None: none), by torchvision's own transforms
        on a stand-in of that size, each pixel operation recorded instead of run."""
        if seed is None:
            return None
        import torch

        stand_in = torch.zeros((), dtype=torch.uint8).expand(3, size, size)  # no pixels are ever read
        ops, boxes = self.recorders
        with seeded(seed):
            for recorder in (ops, boxes):
                recorder.seen.clear()
                if recorder.transform is not None:
                    recorder.transform(stand_in)
        erased = [params for (params,) in boxes.seen if params["v"] is not None]  # v None: nothing erased
        box = tuple(int(erased[0][k]) for k in "ijhw") if erased else None
        return Draws(tuple((op, float(magnitude)) for op, magnitude, *_ in ops.seen), box)

    @functools.cached_property
    def recorders(self) -> tuple[Recorder, Recorder]:
        """This process's own copies of the policy and erasing that record what they would do (see `draws`)."""
        return (Recorder(make_policy(self.policy), "_apply_image_or_video_transform"),
                Recorder(make_erasing(self.erase), "transform"))

    @functools.cached_property
    def transforms(self) -> tuple[Optional[Callable], Optional[Callable]]:
        """This process's policy and erasing (None: not asked for), made once."""
        return make_policy(self.policy), make_erasing(self.erase)


class Recorder:
    """A torchvision transform whose pixel operation (`method`) records its arguments instead of running."""

    def __init__(self, transform: Optional[Callable], method: str) -> None:
        self.transform, self.seen = transform, []
        if transform is not None:
            setattr(transform, method, self.record)

    def record(self, image: Any, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(args)
        return image


INCEPTION_CROP = Augment()  # the defaults: random-resized crop 0.08-1, 3/4-4/3, flip half the images


def make_policy(name: str) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    if name not in POLICY_TABLE:
        raise UserError(f"--auto-augment: unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    from torchvision.transforms import v2  # see make_erasing

    return POLICY_TABLE[name][1](v2)


def make_erasing(probability: float) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    from torchvision.transforms import v2  # imported before the workers fork (pipeline.share_heap_with_workers)

    return v2.RandomErasing(p=probability, value=list(MEAN_PIXEL)) if probability > 0 else None


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's global generator seeded with `seed` for the block, then put back (not torch.manual_seed: its device
    hooks cost far more than the draws)."""
    import torch

    saved = torch.default_generator.get_state()
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.default_generator.set_state(saved)


def check_range(flag: str, pair: tuple[float, float], high: Optional[float] = None) -> None:
    """`--scale 0.5 0.1` and the like: one line naming the flag."""
    low, top = pair
    if low > top:
        raise UserError(f"{flag}: MIN must not exceed MAX, got {low:g} {top:g}")
    if high is not None and top > high:
        raise UserError(f"{flag}: at most {high:g}, got {top:g}")


@dataclass(frozen=True)
class AugmentSettings:
    """Training's augmentation of each sample (`Augment`), and how many times each image repeats in a batch."""

    scale: tuple[float, float] = option(
        (0.08, 1.0), "random-resized crop: the range of its area, as a fraction of the image's", "augment",
        ("MIN", "MAX"), shown_default="0.08 1", nargs=2, type=options.positive_float, exact=True)
    ratio: tuple[float, float] = option(
        (3 / 4, 4 / 3), "random-resized crop: the range of its aspect ratio (width / height)", "augment",
        ("MIN", "MAX"), shown_default="3/4 4/3", nargs=2, type=options.positive_float, exact=True)
    hflip: float = option(0.5, "probability of a horizontal flip; 0 where a mirrored image means something else "
                          "(text, handwriting, many medical scans)", "augment", "P", type=options.probability,
                          exact=True)
    auto_augment: str = option(
        "none", "augmentation policy after the crop, torchvision's: ta_wide (TrivialAugmentWide), ra (RandAugment), "
        "imagenet (AutoAugment's ImageNet policy); in the loader workers, or on the device under --decode gpu",
        "augment", choices=list(POLICIES), exact=True)
    random_erase: float = option(
        0.0, "probability of erasing a random rectangle (torchvision's RandomErasing), filled with the mean pixel",
        "augment", "P", type=options.probability, exact=True)
    ra_reps: int = option(
        1, "repeated augmentation (DeiT, torchvision's --ra-reps): each global batch holds global-batch / N images, "
        "each N times with augmentations of its own, the copies on different ranks; an epoch keeps its steps, so "
        "it sees 1/N of the images", "augment", "N", type=options.repeat_count, exact=True)

    @property
    def augment(self) -> Augment:
        return Augment(tuple(self.scale), tuple(self.ratio), self.hflip, self.auto_augment, self.random_erase)

"""Validation's pixels are the reference's: timm's evaluation transform (`resolve_data_config` + `create_transform`,
as its validate.py runs it) on the same bytes gives the same pixels within rounding, and so the same predictions for
the same weights; `--decode gpu` on the CPU gives the worker path's pixels within a level."""

from __future__ import annotations

import io

import numpy as np
import pytest
import timm
import torch
from conftest import SMALL_RUN
from inprocess import InMemory, evaluate
from makers import encoded, scene, training_images
from PIL import Image
from timm.data import create_transform, resolve_data_config

from imagenet_elastic.data import pipeline
from imagenet_elastic.data.device import gpu_decode, jpeg_decoders
from imagenet_elastic.data.model_input import IMAGENET_MEAN, IMAGENET_STD
from imagenet_elastic.tools.export import crop_fraction, export

CPU = torch.device("cpu")


# Every kind of image a validation set holds: landscape and portrait, larger and smaller than the resize (where our
# old draft decode took 1/2, 1/4, 1/8 DCT scales), grey and CMYK JPEGs, PNGs with alpha and with a palette.
IMAGES = [encoded(scene(w, h, i)) for i, (w, h) in enumerate(
    [(500, 375), (375, 500), (333, 500), (160, 120), (120, 160), (97, 61), (48, 40), (40, 48), (37, 37), (30, 20),
     (800, 90)])] + [
    encoded(scene(140, 100, 20), mode="L"), encoded(scene(120, 90, 21), mode="CMYK"),
    encoded(scene(90, 130, 22), "PNG", "RGBA"), encoded(scene(70, 50, 23), "PNG", "P")]


def memory_split(images: list[bytes], classes: int = 3) -> InMemory:
    labels = np.arange(len(images), dtype=np.int64) % classes
    return InMemory("val", tuple(f"c{k}" for k in range(classes)), tuple(images), labels)


def timm_levels(raw: bytes, crop: int, resize: int, interpolation: str) -> torch.Tensor:
    """timm's eval transform of the bytes, as uint8 levels (mean 0, std 1: ToTensor's x / 255, scaled back): HWC."""
    transform = create_transform((3, crop, crop), crop_pct=crop_fraction(crop, resize), interpolation=interpolation,
                                 mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    return (transform(Image.open(io.BytesIO(raw)).convert("RGB")) * 255).round().to(torch.uint8).permute(1, 2, 0)


@pytest.mark.parametrize("crop, resize, interpolation, levels", [
    (32, 37, "bilinear", 1), (64, 73, "bilinear", 1), (24, 24, "bilinear", 1), (56, 64, "bicubic", 2)])
def test_validation_pixels_are_timms_eval_transform_within_rounding(crop, resize, interpolation, levels):
    """The geometry is the same (a crop half a pixel apart differs by tens of levels on these edges); the resize
    kernels are torchvision's uint8 ones, within 1 level of Pillow's bilinear and 2 of its bicubic."""
    dataset = pipeline.EvalDataset(memory_split(IMAGES), crop, resize, interpolation=interpolation)
    worst = []
    for i, raw in enumerate(IMAGES):
        ours = dataset[i][0]
        theirs = timm_levels(raw, crop, resize, interpolation)
        assert ours.shape == theirs.shape == (crop, crop, 3) and ours.dtype == torch.uint8
        difference = (ours.int() - theirs.int()).abs()
        worst.append(int(difference.max()))
        assert float((difference > 0).float().mean()) < 0.05, (i, float((difference > 0).float().mean()))
    assert max(worst) <= levels, worst


def test_decode_gpu_validates_on_the_worker_paths_pixels(monkeypatch):
    """On the CPU device the batch decoder gives the worker path's pixels: within a level (the float resize's
    rounding against the uint8 kernel's) for the images it decodes itself, bit for bit for those the workers decode
    (PNG, CMYK) and a JPEG the device decoder rejects."""
    source = memory_split(IMAGES)
    rejected = gpu_decode.byte_tensor(IMAGES[2])
    batch_call = jpeg_decoders.TorchvisionJpeg.batch

    def refusing(self, data):
        if any(len(d) == len(rejected) and torch.equal(d, rejected) for d in data):
            raise RuntimeError("nvjpeg: unsupported")
        return batch_call(self, data)

    monkeypatch.setattr(jpeg_decoders.TorchvisionJpeg, "batch", refusing)
    warnings: list[str] = []
    encoded_set = pipeline.EvalDataset(source, 40, 46, gpu_decode.encode_centre_crop)
    batch = gpu_decode.BatchDecoder(CPU, warnings.append)(gpu_decode.collate([encoded_set[i]
                                                                            for i in range(len(source))]))
    expected = torch.stack([pipeline.EvalDataset(source, 40, 46)[i][0] for i in range(len(source))])
    fallbacks = [i for i in range(len(source)) if i == 2 or encoded_set[i][0].cpu_reason]
    assert fallbacks and torch.equal(batch.images[fallbacks], expected[fallbacks])
    assert (batch.images.int() - expected.int()).abs().max() <= 1
    assert any("rejected" in w for w in warnings) and any("PNG" in w for w in warnings), warnings


def validation_seen_by_the_model(argv: list[str], splits) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """What --evaluate feeds the model and what the model answers, image by image, with the scores it records."""
    inputs, outputs = [], []

    def record(module, args, out) -> None:
        if args[0].dim() == 4 and args[0].shape[1] == 3 and out.dim() == 2:  # the whole model: images to logits
            inputs.append(args[0].float())
            outputs.append(out.float())

    with torch.nn.modules.module.register_module_forward_hook(record):
        scores = evaluate(argv, splits)
    return torch.cat(inputs), torch.cat(outputs), scores


def test_timm_evaluating_our_export_predicts_what_our_validation_recorded_image_by_image(tmp_path):
    """A model trained here, exported: timm's own evaluation path on the same bytes sees our validation's pixels
    (after normalisation, within a level's worth) and predicts the same class for every image, in fp32; the
    recorded top-1 is timm's. Under our old validation (DCT-scaled decode, crop before resize) the pixels
    differed by tens of levels on these images."""
    classes = ("a", "b", "c")
    train_images, train_labels = training_images(60, 3, seed=1)
    val_images, val_labels = training_images(45, 3, seed=2)
    splits = (InMemory("train", classes, train_images, train_labels), InMemory("val", classes, val_images, val_labels))
    run = [*SMALL_RUN, "--epochs", "2", "--lr", "0.5", "--workers", "0", "--checkpoints-path", str(tmp_path / "run")]
    from inprocess import train
    train(["unused", *run], splits=splits)
    ours_x, ours_logits, scores = validation_seen_by_the_model(
        ["unused", *run, "--evaluate", "--resume", str(tmp_path / "run" / "last.pt")], splits)

    export(str(tmp_path / "run" / "last.pt"), str(tmp_path / "export"), ema=False)
    model = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True).eval()
    transform = create_transform(**resolve_data_config({}, model=model))  # timm's validate.py
    theirs_x = torch.stack([transform(Image.open(io.BytesIO(raw)).convert("RGB")) for raw in val_images])
    with torch.no_grad():
        theirs_logits = model(theirs_x)

    one_level = 1 / (min(IMAGENET_STD))
    assert ours_x.shape == theirs_x.shape
    difference = (ours_x - theirs_x).abs()
    print(f"max pixel difference {float(difference.max()) * min(IMAGENET_STD):.3f} levels, "
          f"{float((difference > 1e-4).float().mean()):.4f} of values differ; logits max difference "
          f"{float((ours_logits - theirs_logits).abs().max()):.2e}")
    assert float(difference.max()) <= one_level * 1.001
    agree = (ours_logits.argmax(1) == theirs_logits.argmax(1)).float().mean()
    assert agree >= 0.99, float(agree)
    theirs_top1 = 100 * float((theirs_logits.argmax(1) == torch.from_numpy(val_labels)).float().mean())
    assert scores["val_top1"] == pytest.approx(theirs_top1)
    assert 40 < scores["val_top1"] < 100  # a model that learned something, and images it is unsure of
    assert tuple(m / 255 for m in IMAGENET_MEAN) == pytest.approx(model.pretrained_cfg["mean"])

"""How often our validation and timm's own evaluation path predict the same class for the same image, on the same
weights: our checkpoint through our validation pipeline (EvalDataset, our normalisation, the model in fp32 and
under bf16 autocast), its export through timm's (`resolve_data_config` + `create_transform`, Pillow, fp32).

    python scripts/timm_agreement.py CHECKPOINT VAL_FOLDER [--batch-size 64]

Prints one JSON line: images, top-1 of each path, the share of images whose predictions agree, and the largest
difference between the two preprocessed tensors (in levels of 1/255).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config

from imagenet_elastic.checkpoint import store
from imagenet_elastic.config import eval_sizes
from imagenet_elastic.data.model_input import IMAGENET_MEAN, IMAGENET_STD
from imagenet_elastic.data.pipeline import EvalDataset
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.models.create import create_model
from imagenet_elastic.tools.export import export


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("val")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    snapshot = store.load(args.checkpoint)
    model = create_model(snapshot["model_name"], len(snapshot["classes"])).eval()
    model.load_state_dict(snapshot["model"])
    settings = snapshot["config"]
    crop, resize = eval_sizes(settings["image_size"], settings.get("val_crop_size"), settings.get("val_resize"))
    source = scan_image_folder(args.val, "val")
    ours = EvalDataset(source, crop, resize)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with tempfile.TemporaryDirectory() as folder:
        export(args.checkpoint, f"{folder}/export", ema=False)
        reference = timm.create_model(f"local-dir:{folder}/export", pretrained=True).eval()
    transform = create_transform(**resolve_data_config({}, model=reference))
    labels = torch.from_numpy(source.labels)
    predictions: dict[str, list[torch.Tensor]] = {"fp32": [], "bf16": [], "timm": []}
    worst = 0.0
    with torch.no_grad():
        for start in range(0, len(source), args.batch_size):
            indices = range(start, min(start + args.batch_size, len(source)))
            x = torch.stack([ours[i][0] for i in indices]).permute(0, 3, 1, 2).float().sub_(mean).div_(std)
            predictions["fp32"].append(model(x).argmax(1))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                predictions["bf16"].append(model(x).float().argmax(1))
            theirs = torch.stack([transform(Image.open(source.path(i)).convert("RGB")) for i in indices])
            predictions["timm"].append(reference(theirs).argmax(1))
            worst = max(worst, float(((x - theirs) * std).abs().max()))
    found = {name: torch.cat(p) for name, p in predictions.items()}
    print(json.dumps({
        "images": len(source), "model": snapshot["model_name"], "crop": crop, "resize": resize,
        **{f"top1_{name}": round(100 * float((p == labels).float().mean()), 2) for name, p in found.items()},
        "agree_fp32_timm": round(float((found["fp32"] == found["timm"]).float().mean()), 4),
        "agree_bf16_timm": round(float((found["bf16"] == found["timm"]).float().mean()), 4),
        "max_pixel_difference_levels": round(worst, 3)}))


if __name__ == "__main__":
    main()

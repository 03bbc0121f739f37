"""What tests build to run on: JPEGs (noise and photo-like), class folders, WebDataset shards and their
damage, parquet files in a hub cache layout, packs, published weights in a hub cache, a training state."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Union

import numpy as np
import torch
from PIL import Image

from imagenet_elastic.data import sources
from imagenet_elastic.data.sources import tar_shards
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.models.create import create_model
from imagenet_elastic.optim.optimizer import create_optimizer
from imagenet_elastic.train.state import TrainState

REVISION = "0123456789abcdef0123456789abcdef01234567"  # the hub cache's one revision of published weights
CLASSES = ("ant", "bee", "cat")  # make_state's model's classes


def write_jpeg(path, width: int, height: int, seed: int, subsampling: Union[int, str] = -1) -> None:
    """A noisy JPEG: any two different crops of it differ in their pixels. `subsampling`: PIL's chroma
    subsampling, -1 libjpeg's default (4:2:0: chroma at half the resolution), "4:4:4" none."""
    save_jpeg(path, np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8), subsampling)


def save_jpeg(path, pixels: np.ndarray, subsampling: Union[int, str] = -1) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG", quality=90, subsampling=subsampling)


def photo_like(width: int, height: int, seed: int) -> np.ndarray:
    """HWC uint8 pixels that look like a photograph to a JPEG decoder, unlike noise: shading that varies
    smoothly, six discs and boxes of moderately saturated colour with soft (anti-aliased) edges, and mild grain,
    mostly in brightness. Colour changes sharply only at the shapes' edges, as in a photo, so where two decoders
    fill 4:2:0 chroma differently (nvJPEG by nearest sample, libjpeg-turbo by interpolation) they differ there
    alone (tests/gpu/test_gpu_probes.py measures it)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)

    def colour() -> np.ndarray:  # a brightness, and each channel within 50 levels of it
        return rng.uniform(40, 215) + rng.uniform(-50, 50, 3)

    u, v = (x / width)[..., None], (y / height)[..., None]
    corners = [colour() for _ in range(4)]
    image = corners[0] * (1 - u) * (1 - v) + corners[1] * u * (1 - v) + corners[2] * (1 - u) * v + corners[3] * u * v
    for k in range(6):
        cx, cy, radius = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(0.08, 0.3) * min(width, height)
        outside = np.hypot(x - cx, y - cy) if k % 2 else np.maximum(abs(x - cx), abs(y - cy))
        cover = np.clip(0.5 - (outside - radius) / 3, 0, 1)[..., None]  # a 3-pixel soft edge
        shading = 1 + 0.2 * np.sin((x + y) / rng.uniform(8, 30))[..., None]
        image = image * (1 - cover) + colour() * shading * cover
    image += rng.normal(0, 3, (height, width, 1)) + rng.normal(0, 1, (height, width, 3))  # grain
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def write_photo(path, width: int, height: int, seed: int) -> None:
    """A photo-like JPEG (`photo_like`) at quality 90 with 4:2:0 chroma, as most cameras' and ImageNet's are."""
    save_jpeg(path, photo_like(width, height, seed))


def scene(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour fields with noise and a sharp disc: edges and texture, as photographs have."""
    rng = np.random.default_rng(seed)
    x, y = np.linspace(0, 1, width)[None, :, None], np.linspace(0, 1, height)[:, None, None]
    pixels = 127 + 90 * np.sin(7 * x + 4 * y + np.arange(3) + seed) + rng.normal(0, 25, (height, width, 3))
    yy, xx = np.ogrid[:height, :width]
    disc = (yy - height * rng.uniform(0.3, 0.7)) ** 2 + (xx - width * rng.uniform(0.3, 0.7)) ** 2 \
        <= (min(width, height) * rng.uniform(0.15, 0.3)) ** 2
    pixels[disc] = rng.integers(0, 256, 3)
    return pixels.clip(0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, kind: str = "JPEG", mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format=kind, **({"quality": 90} if kind == "JPEG" else {}))
    return out.getvalue()


def training_images(count: int, classes: int, seed: int) -> tuple[tuple[bytes, ...], np.ndarray]:
    """Learnable: class k's disc has its own colour, on scenes of varied sizes."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(count):
        label = i % classes
        w, h = int(rng.integers(40, 200)), int(rng.integers(40, 200))
        pixels = scene(w, h, seed * 1000 + i) // 3
        yy, xx = np.ogrid[:h, :w]
        r = min(w, h) * rng.uniform(0.2, 0.35)
        pixels[(yy - h / 2 - rng.uniform(-0.1, 0.1) * h) ** 2 + (xx - w / 2) ** 2 <= r * r] = \
            [100 + 20 * label, 120, 140 - 20 * label]
        images.append(encoded(pixels))
        labels.append(label)
    return tuple(images), np.array(labels, dtype=np.int64)


def make_split(root, classes: dict[str, int], size=(48, 40)) -> None:
    seed = 0
    for name, count in classes.items():
        for i in range(count):
            write_jpeg(os.path.join(root, name, f"img{i}.jpg"), *size, seed=seed)
            seed += 1


def damage(path: str, how: str, array: str = "paths") -> str:
    """The index file at `path` as a crash, a full disk or another program leaves it (or an older program, without
    `array`); what its note says."""
    with open(path, "rb") as f:
        data = f.read()
    damaged, said = {"empty": (b"", "is empty"),
                     "cut short": (data[:len(data) // 2], "is damaged (File is not a zip file)"),
                     "not an npz": (b"not an npz file", "is not a numpy .npz file"),
                     "an array missing": (None, f"is damaged ({array} is not a file in the archive)")}[how]
    if damaged is None:  # a whole .npz of this version, one array short
        with np.load(path) as saved:
            arrays = {k: saved[k] for k in saved.files if k != array}
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    else:
        with open(path, "wb") as f:
            f.write(damaged)
    return said


def flatten(image_folder, out) -> list[tuple[str, str]]:
    """The fixture's val images in one folder as ILSVRC2012_val_NNNNNNNN.JPEG, and (file, class) of each."""
    out.mkdir()
    val = scan_image_folder(str(image_folder / "val"), "val")
    rows = []
    for i in range(len(val)):
        name = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
        shutil.copy(val.path(i), out / name)
        rows.append((name, val.classes[val.label(i)]))
    return rows


def wds_shards(folder, out, per_shard: int = 20) -> list[str]:
    """The folder's images written by WebDataset's ShardWriter, as `KEY.jpg` + `KEY.cls` samples."""
    index = scan_image_folder(str(folder), "train")
    os.makedirs(out, exist_ok=True)
    import webdataset as wds  # not on every machine: its tests' own import

    with wds.ShardWriter(os.path.join(str(out), "part-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(len(index)):
            sink.write({"__key__": f"sample{i:05d}", "jpg": index.read(i), "cls": index.label(i)})
    return sorted(os.path.join(str(out), n) for n in os.listdir(out))


def relabel_in_place(shard, sample: int, label: int) -> None:
    """Change the label of the shard's sample-th sample (its .cls member's one digit) where it lies: the same size,
    a new mtime."""
    with tarfile.open(shard) as tar:
        member = [m for m in tar.getmembers() if m.name.endswith(".cls")][sample]
    assert member.size == 1
    time.sleep(0.01)
    with open(shard, "r+b") as f:
        f.seek(member.offset_data)
        f.write(str(label).encode())


def flip_byte_in_place(shard, offset: int, keep_mtime: bool = False) -> None:
    """One bit of the byte at `offset` flipped where it lies (the same size), as storage that rots or a tool that
    edits in place leaves it; the mtime a second later, or (`keep_mtime`) as it was."""
    stat = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + (0 if keep_mtime else 10**9)))


def middle_of_image(source: tar_shards.TarShards, i: int) -> int:
    """A byte inside sample i's image data, far from its JPEG header: a decoder at most warns of it."""
    return int(source.offsets[i]) + int(source.lengths[i]) // 2


def write_parquet(path, images: list[bytes], labels: list[int], names: tuple[str, ...] | None, rows_per_group: int,
                  image_paths: list[str] | None = None) -> None:
    """A file as the `datasets` library writes imagenet-1k: image{bytes,path}, label, ClassLabel names."""
    import pyarrow as pa  # not on every machine: its tests' own import
    import pyarrow.parquet as pq

    paths = image_paths or [f"img{k}.JPEG" for k in range(len(images))]
    table = pa.table({"image": [{"bytes": b, "path": p} for b, p in zip(images, paths)],
                      "label": pa.array(labels, type=pa.int64())})
    if names is not None:
        features = {"image": {"_type": "Image"}, "label": {"names": list(names), "_type": "ClassLabel"}}
        table = table.replace_schema_metadata({b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    pq.write_table(table, path, row_group_size=rows_per_group)


def hub_folder(image_folder, root, rows_per_group: int = 7):
    """The fixture's splits as the Hub keeps imagenet-1k: ROOT/data/{train-0000k-of-00002, validation-00000-of-00001,
    test-00000-of-00001}.parquet (the test split unlabelled: -1), class names in the files."""
    train, val = sources.open_splits(str(image_folder), None, None, None)
    hub = root / "data"
    hub.mkdir(parents=True)
    half = len(train) // 2
    for k, part in enumerate((range(half), range(half, len(train)))):
        write_parquet(hub / f"train-{k:05d}-of-00002.parquet", [train.read(i) for i in part],
                      [train.label(i) for i in part], train.classes, rows_per_group)
    write_parquet(hub / "validation-00000-of-00001.parquet", [val.read(i) for i in range(len(val))],
                  val.labels.tolist(), val.classes, rows_per_group,
                  [f"ILSVRC2012_val_{i + 1:08d}.JPEG" for i in range(len(val))])
    write_parquet(hub / "test-00000-of-00001.parquet", [val.read(0)], [-1], val.classes, 1)
    return root


def run_pack(*argv: str) -> dict:
    """`imagenet-elastic pack ARGV` in this process; its JSON line."""
    from imagenet_elastic.tools import pack

    captured = io.StringIO()
    stdout, sys.stdout = sys.stdout, captured
    try:
        pack.main(list(argv))
    finally:
        sys.stdout = stdout
    return json.loads(captured.getvalue().strip().splitlines()[-1])


def publish(folder: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """timm's save_for_hf (config.json + model.safetensors), as `imagenet-elastic export` writes it."""
    from timm.models import save_for_hf

    save_for_hf(model, str(folder), safe_serialization=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def cached(cache: Path, repo: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`repo` in the hub cache as a download leaves it: snapshots/REVISION/ and refs/main naming it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REVISION)
    return publish(root / "snapshots" / REVISION, model)


def timm_model(name: str, classes: int, seed: int) -> torch.nn.Module:
    import timm

    torch.manual_seed(seed)
    return timm.create_model(name, num_classes=classes)


def make_state(seed: int, opt: str = "sgd") -> TrainState:
    torch.manual_seed(seed)
    model = create_model("test_resnet", num_classes=len(CLASSES))
    optimizer = create_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-4, device=torch.device("cpu"), name=opt)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return TrainState(model=model, optimizer=optimizer, scaler=scaler)


def steps(state: TrainState, first: int, count: int) -> None:
    """Made-up gradients, a function of the step number (no forward pass: keeps the test fast)."""
    for step in range(first, first + count):
        generator = torch.Generator().manual_seed(step)
        for param in state.model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        state.optimizer.step()

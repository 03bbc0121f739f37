#!/usr/bin/env python
"""Which settings of `--decode gpu`'s JPEG libraries keep up beside a compiled training step; not installed.

    python bench/gpu_decoder_settings.py DATA [--compile-cache FILE] [--batches N] [--few 4] [--settings A,B]

For each of nvImageCodec's settings below (its backends, its CPU threads, nvJPEG's Huffman threshold), first the
library alone (batches of DATA's JPEGs decoded back to back, the device otherwise idle: what it can supply), then
compiled end to end beside training at the node's loader workers and at --few, with torchvision's decoder and
`--decode cpu` as references, and the compiled model alone (the limit) measured in the same process. One JSON line
each. A setting replaces the nvimgcodec line of jpeg_decoders.JPEG_DECODERS in this process; `product` is the
line as training has it (every backend, the CPU threads decoding.Decoding.library_threads leaves beside the loader
workers; alone, a thread per core). MODEL, BATCH and SIZE from the environment make it small: on a CPU the library
runs its CPU backend, which every setting below then shares.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
for folder in (REPO, REPO / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from gpu_proof import load_compile_cache  # noqa: E402

from imagenet_elastic.data import sources  # noqa: E402
from imagenet_elastic.data.device import jpeg_decoders  # noqa: E402
from imagenet_elastic.tools import benchmark, throughput  # noqa: E402

MODEL = os.environ.get("MODEL", "resnet50")
BATCH = int(os.environ.get("BATCH", "256"))
SIZE = int(os.environ.get("SIZE", "224"))

# name: (backend kinds, None: every one the library has; CPU threads, None: the product's, 0: one per core; more
# of its decoder options)
SETTINGS: dict[str, tuple[Optional[tuple[str, ...]], Optional[int], str]] = {
    "product": (None, None, ""),
    "threads_per_core": (None, 0, ""),
    "threads_2": (None, 2, ""),
    "gpu_hw_threads_2": (("HW_GPU_ONLY", "GPU_ONLY"), 2, "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"),
    "gpu_only_threads_2": (("GPU_ONLY",), 2, "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"),
    "hw_only": (("HW_GPU_ONLY",), 2, ""),
}
PRODUCT = jpeg_decoders.JPEG_DECODERS["nvimgcodec"]


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def use_setting(name: str) -> Callable[[torch.device, int], jpeg_decoders.NvImageCodecJpeg]:
    """--gpu-decoder nvimgcodec made with setting `name` from here on (on a CPU its CPU backend, whatever the
    setting); its maker, (device, the product's threads) -> the decoder."""
    backends, threads, options = SETTINGS[name]

    def make(device: torch.device, product_threads: int) -> jpeg_decoders.NvImageCodecJpeg:
        return jpeg_decoders.NvImageCodecJpeg(device, product_threads if threads is None else threads, backends,
                                              options)

    jpeg_decoders.JPEG_DECODERS["nvimgcodec"] = PRODUCT._replace(make=make)
    return make


def jpeg_batches(data: str, count: int) -> list[list[torch.Tensor]]:
    files = sorted(f for f in Path(data, "train").rglob("*") if f.suffix.lower() in (".jpg", ".jpeg"))[:BATCH * count]
    if len(files) < BATCH:
        raise SystemExit(f"gpu_decoder_settings: {data}/train holds {len(files)} JPEGs, fewer than a batch ({BATCH})")
    raw = [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files]
    return [raw[i:i + BATCH] for i in range(0, len(raw) - BATCH + 1, BATCH)]


def alone(decoder: jpeg_decoders.NvImageCodecJpeg, batches: list[list[torch.Tensor]]) -> dict[str, Any]:
    """The library by itself: images per second, and how many of a batch it decoded (the rest None)."""
    device = decoder.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    decoded = decoder.decode(batches[0])
    sync()
    start = time.perf_counter()
    for batch in batches[1:]:
        decoder.decode(batch)
    sync()
    seconds = time.perf_counter() - start
    return {"alone_images_per_sec": round(BATCH * (len(batches) - 1) / seconds, 1),
            "decoded": sum(image is not None for image in decoded), "of": len(decoded)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--compile-cache", help="a compile_cache.bin(.gz) to start warm from (gpu_proof's)")
    p.add_argument("--batches", type=int, default=40, help="measured batches of each end-to-end case")
    p.add_argument("--few", type=int, default=4, help="the fewer loader workers")
    p.add_argument("--settings", default=",".join(SETTINGS), help="a comma list of: " + ", ".join(SETTINGS))
    a = p.parse_args()
    names = a.settings.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.compile_cache:
        emit({"compile_cache": load_compile_cache(a.compile_cache)})
    batches = jpeg_batches(a.data, 6)
    for name in names:
        make = use_setting(name)
        try:
            emit({"setting": name, "device": device.type, **alone(make(device, 0), batches)})
        except Exception as error:  # a backend this GPU lacks costs its line
            emit({"setting": name, "failed": f"{type(error).__name__}: {error}"[:300]})
    many = max(1, (os.cpu_count() or 2) - 2)
    train = sources.open_source(sources.train_location(a.data), "train", None)
    compiled = ["--image-size", str(SIZE), "--amp", "bf16", "--channels-last",
                "--compile" if device.type == "cuda" else "--no-compile"]
    common = [a.data, "--model", MODEL, "--batch-size", str(BATCH), "--batches", str(a.batches), *compiled]
    context = None
    cases: list[tuple[str, list[str], Optional[str]]] = [("limit", ["--mode", "synthetic"], None)]
    for workers in dict.fromkeys((many, a.few)):  # one count where the node has few cores
        cases += [(f"cpu_{workers}", ["--decode", "cpu", "--workers", str(workers)], None),
                  (f"torchvision_{workers}", ["--decode", "gpu", "--gpu-decoder", "torchvision", "--workers",
                                              str(workers)], None)]
        cases += [(f"{name}_{workers}", ["--decode", "gpu", "--gpu-decoder", "nvimgcodec", "--workers", str(workers)],
                   name) for name in names]
    for case, flags, setting in cases:
        args = benchmark.build_parser().parse_args([*common, *(["--mode", "end_to_end"] if "--mode" not in flags
                                                               else []), *flags])
        if context is None:
            context = throughput.step_context(args, len(train.classes))
        if setting is not None:
            use_setting(setting)
        start = time.time()
        try:
            line = throughput.run_synthetic(args, len(train.classes), context) if args.mode == "synthetic" else \
                throughput.run_end_to_end(args, train, args.workers, context)
        except Exception as error:
            emit({"case": case, "failed": f"{type(error).__name__}: {error}"[:300]})
            continue
        emit({"case": case, "seconds": round(time.time() - start, 1), "images_per_sec": line["images_per_sec"],
              "workers": line.get("workers"), "gpu_decoder": line.get("gpu_decoder"), "setting": setting})


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Which settings of `--decode gpu`'s JPEG libraries keep up beside a compiled training step; not installed.

    python bench/gpu_decoder_settings.py DATA [--compile-cache FILE] [--batches N] [--few 4]

For each of nvImageCodec's settings below (its backends, its CPU threads, nvJPEG's Huffman threshold), first the
library alone (batches of DATA's JPEGs decoded back to back, the device otherwise idle: what it can supply), then
compiled end to end beside training at the node's loader workers and at --few, with torchvision's decoder and
`--decode cpu` as references, and the compiled model alone (the limit) measured in the same process. One JSON line
each. The settings are tried by replacing NvImageCodecJpeg.make_decoder in this process, so the product's own
choice is the `default` line. MODEL, BATCH and SIZE from the environment make it small: on a CPU the library runs
its CPU backend, which every setting below then shares.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from imagenet_elastic.data import jpeg_decoders, sources  # noqa: E402
from imagenet_elastic.tools import benchmark, throughput  # noqa: E402

MODEL = os.environ.get("MODEL", "resnet50")
BATCH = int(os.environ.get("BATCH", "256"))
SIZE = int(os.environ.get("SIZE", "224"))

# name: (backend kinds, None: the library's choice of all; CPU threads, 0: one per core; extra options)
SETTINGS: dict[str, tuple[Optional[tuple[str, ...]], int, str]] = {
    "default": (None, 0, ""),
    "threads_2": (None, 2, ""),
    "gpu_hw_threads_2": (("HW_GPU_ONLY", "GPU_ONLY"), 2, "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"),
    "gpu_only_threads_2": (("GPU_ONLY",), 2, "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"),
    "hw_only": (("HW_GPU_ONLY",), 2, ""),
}


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def use_setting(name: str) -> None:
    """NvImageCodecJpeg's decoder made with setting `name` (on CUDA; a CPU keeps its CPU backend)."""
    kinds, threads, extra = SETTINGS[name]
    original = jpeg_decoders.NvImageCodecJpeg.__dict__.get("original_make_decoder") or \
        jpeg_decoders.NvImageCodecJpeg.make_decoder
    jpeg_decoders.NvImageCodecJpeg.original_make_decoder = original

    def make_decoder(self) -> None:
        if self.device.type != "cuda":
            return original(self)
        nvimgcodec = jpeg_decoders.import_nvimgcodec()
        backends = None if kinds is None else [nvimgcodec.Backend(getattr(nvimgcodec, kind)) for kind in kinds]
        self.decoder = nvimgcodec.Decoder(device_id=jpeg_decoders.device_index(self.device),
                                          max_num_cpu_threads=threads, backends=backends,
                                          options=" ".join([":fancy_upsampling=1", extra]).strip())
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False)

    jpeg_decoders.NvImageCodecJpeg.make_decoder = make_decoder


def jpeg_batches(data: str, count: int) -> list[list[torch.Tensor]]:
    files = sorted(f for f in Path(data, "train").rglob("*") if f.suffix.lower() in (".jpg", ".jpeg"))[:BATCH * count]
    if len(files) < BATCH:
        raise SystemExit(f"gpu_decoder_settings: {data}/train holds {len(files)} JPEGs, fewer than a batch ({BATCH})")
    raw = [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files]
    return [raw[i:i + BATCH] for i in range(0, len(raw) - BATCH + 1, BATCH)]


def alone(device: torch.device, batches: list[list[torch.Tensor]]) -> dict[str, Any]:
    """The library by itself: images per second, and how many of a batch it decoded (the rest None)."""
    decoder = jpeg_decoders.NvImageCodecJpeg(device)
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
    if a.compile_cache and os.path.exists(a.compile_cache):
        from imagenet_elastic.models import compile_cache

        raw = Path(a.compile_cache).read_bytes()
        _, blob = compile_cache.decode(gzip.decompress(raw) if a.compile_cache.endswith(".gz") else raw)
        emit({"compile_cache": "loaded" if torch.compiler.load_cache_artifacts(blob) is not None else "not loaded"})
    batches = jpeg_batches(a.data, 6)
    for name in names:
        use_setting(name)
        try:
            emit({"setting": name, "device": device.type, **alone(device, batches)})
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

"""`python bench/store_reading.py`: training's reads from an object store against the same pack on local disk.

A pack of fake ImageNet-sized JPEGs is uploaded to moto's S3 server on 127.0.0.1 (scripts/store_servers.py), read
through a proxy that counts requests and bytes. Our loader (`imagenet-elastic benchmark --mode loader`, every image
read, checked and decoded once) runs over it with an empty node cache (the first epoch), again with the cache warm,
over the pack on disk, and with a cache capped at half the pack (an epoch's order is a full shuffle, so such a cache
fetches shards again within the epoch); each line says images/s, the store's requests and bytes per sample, and the
cache's size on disk. `startup` times what a start does before the first step for a simulated pack index of ImageNet's
1,281,167 samples in 1,024 shards: list the shards, fetch and read the index, take the split's fingerprint. One JSON
line per measurement; docs/BENCHMARKS.md records them. The loopback server measures our client and cache, not a
network: a real store adds each request's round trip, which whole-shard reads pay once per 16 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # this checkout's package, and the harness
import store_servers  # noqa: E402

IMAGENET_TRAIN_IMAGES = 1_281_167


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def make_pack(folder: Path, images: int, shard_size: int) -> Path:
    """Fake ImageNet images (400x300 px, 10 classes) packed as `imagenet-elastic pack` writes them."""
    import make_fake_imagenet

    per_class = max(1, images // 10)
    for split, count in (("train", per_class), ("val", 2)):
        make_fake_imagenet.make_split(str(folder / "images"), split, 10, count, (400, 300), seed=0)
    subprocess.run([sys.executable, "-m", "imagenet_elastic", "pack", str(folder / "images"), str(folder / "pack"),
                    "--shard-size", str(shard_size)], cwd=REPO, check=True, capture_output=True)
    return folder / "pack"


def loader(data: str, env: dict, args: argparse.Namespace) -> dict:
    batches = args.images // args.batch_size
    result = subprocess.run([sys.executable, "-m", "imagenet_elastic", "benchmark", data, "--mode", "loader",
                             "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--batches",
                             str(batches), "--rounds", "1", "--image-size", "224"],
                            cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_loader(args: argparse.Namespace, scratch: Path) -> None:
    pack = make_pack(scratch, args.images, args.shard_size)
    pack_bytes = sum(p.stat().st_size for p in (pack / "train").glob("*.tar"))
    with store_servers.S3Server(log_dir=scratch) as server, store_servers.FaultProxy(server, log_dir=scratch) as proxy:
        server.put_folder(pack, "bench", "pack")
        cache = scratch / "node-cache"
        env = {**os.environ, **proxy.env(), "IMAGENET_ELASTIC_STORE_CACHE": str(cache)}
        half = {**env, "IMAGENET_ELASTIC_STORE_CACHE": str(scratch / "half-cache"),
                "IMAGENET_ELASTIC_STORE_CACHE_GB": str(pack_bytes / 2 / 2**30)}
        for phase, data, phase_env in (("disk", str(pack), env), ("store, empty cache", "s3://bench/pack", env),
                                       ("store, warm cache", "s3://bench/pack", env),
                                       ("store, cache of half the pack", "s3://bench/pack", half)):
            proxy.reset_stats()
            found = loader(data, phase_env, args)
            cache = Path(phase_env["IMAGENET_ELASTIC_STORE_CACHE"])
            stats = proxy.stats()
            emit(mode="loader", phase=phase, images=found["images"], workers=args.workers,
                 images_per_sec=found["ours_images_per_sec"], pack_mb=round(pack_bytes / 2**20, 1),
                 store_requests_per_sample=round(stats["requests"] / found["images"], 4),
                 store_bytes_per_sample=round(stats["bytes"] / found["images"]),
                 bytes_read_over_pack=round(stats["bytes"] / pack_bytes, 3),
                 cache_disk_mb=round(sum(p.stat().st_size for p in cache.glob("*")) / 2**20, 1)
                 if cache.exists() else 0.0,
                 peak_host_rss_mb=found["peak_host_rss_mb"], peak_child_rss_mb=found["peak_child_rss_mb"])


def run_startup(args: argparse.Namespace, scratch: Path) -> None:
    """A pack index of ImageNet's size whose 1,024 shards are small objects of the sizes it records: what a start
    reads of a store before the first sample (nothing here reads a sample)."""
    import numpy as np

    from imagenet_elastic.data.sources import fingerprints, open_source, tar_shards

    split = scratch / "index-pack" / "train"
    split.mkdir(parents=True)
    entries, shards = args.index_samples, 1024
    shard = (np.arange(entries) * shards // entries).astype(np.int32)
    paths = [str(split / f"shard-{k:06d}.tar") for k in range(shards)]
    for path in paths:
        Path(path).write_bytes(b"\0" * 1024)
    index = tar_shards.TarShards(str(split), "train", tuple(paths), np.full(shards, 1024, dtype=np.int64),
                                 np.zeros(shards, dtype=np.int64), tuple(f"n{c:08d}" for c in range(1000)),
                                 np.arange(entries, dtype=np.int64) * 1000 // entries, shard,
                                 np.full(entries, 512, dtype=np.int64), np.full(entries, 110_000, dtype=np.int64),
                                 checksums=np.zeros(entries, dtype=np.uint32))
    tar_shards.write_index(index, str(split / tar_shards.INDEX_NAME), relative_to=str(split))
    with store_servers.S3Server(log_dir=scratch) as server, store_servers.FaultProxy(server, log_dir=scratch) as proxy:
        server.put_folder(split.parent, "bench", "index-pack")
        os.environ.update({**proxy.env(), "IMAGENET_ELASTIC_STORE_CACHE": str(scratch / "startup-cache")})
        for phase in ("empty cache", "warm cache"):
            proxy.reset_stats()
            start = time.perf_counter()
            source = open_source("s3://bench/index-pack/train", "train", None)
            opened = time.perf_counter() - start
            digest = time.perf_counter()
            fingerprints.fingerprint(source)  # the checkpoint's, and source.fingerprint(): the ranks' comparison
            source.fingerprint()
            emit(mode="startup", phase=phase, samples=len(source), shards=len(source.shards),
                 open_seconds=round(opened, 2), fingerprints_seconds=round(time.perf_counter() - digest, 2),
                 store_requests=proxy.stats()["requests"], store_mb=round(proxy.stats()["bytes"] / 2**20, 1),
                 index_file_mb=round((split / tar_shards.INDEX_NAME).stat().st_size / 2**20, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("loader", "startup", "all"), default="all")
    p.add_argument("--images", type=int, default=1280, help="training images of the pack (loader)")
    p.add_argument("--shard-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--index-samples", type=int, default=IMAGENET_TRAIN_IMAGES, help="samples of the index (startup)")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="store-reading-"))
    try:
        if args.mode in ("loader", "all"):
            run_loader(args, scratch)
        if args.mode in ("startup", "all"):
            run_startup(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What a checkpoint keeps of each split it was trained and validated on, and how a split now differs from it.

A resume on other data is no longer the run it continues (the sampler's order follows the count), nor --evaluate on
other data the score the run printed; the start says so in one line, without raising. The fingerprint is cheap enough
for every start (from arrays the source holds; no data read) and small enough for every checkpoint: the count and an
8-byte digest per block of consecutive samples, at most MAX_BLOCKS (32 kB); blocks of one sample (splits of up to
4,096) name the first sample that differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from imagenet_elastic.data.sources.base import Source

MAX_BLOCKS = 4096
DIGEST_BYTES = 8
CHUNK_SAMPLES = 1 << 16  # columns are turned into bytes this many samples at a time: bounded memory at 1.28 M


@dataclass(frozen=True)
class Fingerprint:
    count: int
    block: int  # samples a digest covers (the last block may hold fewer)
    blocks: bytes  # DIGEST_BYTES a block

    def saved(self) -> dict[str, Any]:
        """As a checkpoint keeps it (plain types: checkpoints load with weights_only)."""
        return {"count": self.count, "block": self.block, "blocks": self.blocks}


def fingerprint(source: Source, block: Optional[int] = None) -> Fingerprint:
    """`source`'s fingerprint in blocks of `block` samples (default: as few as make at most MAX_BLOCKS)."""
    columns = source.sample_columns()
    count = len(source)
    block = block or max(1, -(-count // MAX_BLOCKS))
    digests = []
    chunk = max(1, CHUNK_SAMPLES // block) * block
    for start in range(0, count, chunk):
        streams = [stream for column in columns for stream in _streams(column[start:start + chunk])]
        for lo in range(0, min(chunk, count - start), block):
            digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
            for data, bounds in streams:
                digest.update(data[bounds[lo]:bounds[min(lo + block, len(bounds) - 1)]])
            digests.append(digest.digest())
    return Fingerprint(count, block, b"".join(digests))


def _streams(column: np.ndarray) -> list[tuple[memoryview, np.ndarray]]:
    """A column as byte streams and each sample's start in them (one past the last at the end), whatever numpy's
    string width: a longer name added must not change every block. Numbers are taken as int64."""
    if column.dtype.kind == "S":
        width = column.dtype.itemsize
        cells = np.ascontiguousarray(column).view(np.uint8).reshape(len(column), width)
        filled = cells != 0  # a name holds no NUL: numpy pads with them
        lengths = filled.sum(axis=1, dtype=np.int64)
        return [_fixed(lengths), (memoryview(np.ascontiguousarray(cells[filled])),
                                  np.concatenate(([0], np.cumsum(lengths))))]
    return [_fixed(column.astype(np.int64, copy=False))]


def _fixed(values: np.ndarray) -> tuple[memoryview, np.ndarray]:
    data = np.ascontiguousarray(values)
    return memoryview(data).cast("B"), np.arange(len(data) + 1, dtype=np.int64) * data.itemsize


def difference(saved: Optional[dict[str, Any]], source: Source, taken: Optional[Fingerprint] = None) -> Optional[str]:
    """How `source` differs from the split a checkpoint's fingerprint `saved` was taken of, in one line; else None."""
    if not saved:
        return None
    before_count, block, before = int(saved["count"]), int(saved["block"]), bytes(saved["blocks"])
    now = taken if taken is not None and taken.block == block else fingerprint(source, block)
    if now.count == before_count and now.blocks == before:
        return None
    common = min(len(before), len(now.blocks)) // DIGEST_BYTES
    k = next((k for k in range(common) if before[k * DIGEST_BYTES:(k + 1) * DIGEST_BYTES]
              != now.blocks[k * DIGEST_BYTES:(k + 1) * DIGEST_BYTES]), common)
    first, last = k * block, min((k + 1) * block, max(before_count, now.count)) - 1
    counts = f"{source.role} data: {before_count:,} samples in the checkpoint's run, {now.count:,} now"
    if first >= now.count:
        return f"{counts}; the first that differs, #{first:,}, is gone"
    if block == 1 or first == last:
        return f"{counts}; the first that differs is #{first:,}, now {source.name(first)}"
    return f"{counts}; the first difference lies in samples #{first:,}-#{last:,}, now from {source.name(first)}"

"""Is an index still its shards'? A stat of each shard against the size and mtime the index recorded, a walk of
those that differ, and what follows: a pack's index whose shards changed is refused (saying how to pack again), a
cache of shards from elsewhere is rebuilt from the walk.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Optional

import numpy as np

from imagenet_elastic.data.sources.tar_index import TarShards, pack_again
from imagenet_elastic.data.sources.tar_walk import Found, assemble, walk_shard
from imagenet_elastic.errors import UserError


def check_shards(source: TarShards, index: str, classes: Optional[tuple[str, ...]] = None) -> TarShards:
    """The index `source` (read from `index`) if its shards are still the ones it describes.

    Each shard's size and st_mtime_ns, taken when it was indexed, against a `stat` of it now: one call a shard,
    milliseconds for 1,024 shards, where a digest of their contents would read 140 GB and one of their
    member headers 2.5 M scattered blocks at every start. Any write changes the mtime, so a shard changed in place
    at its old size is seen, and a copy that keeps mtimes (`cp -a`, `rsync -a`, `tar x`) of a changed shard carries
    the changed one's mtime, not the one recorded. What mtimes cannot tell is a faithful copy that does not keep
    them (`cp -r`, most object-store downloads): a shard whose size is the same and mtime is not is therefore
    walked again (its tar headers and labels, ~40 ms for 1,250 samples) and compared with the index. Equal headers
    are a copy, or bytes changed in place at the same size: reading every byte to tell which would cost a copied
    pack 140 GB at every start, so the samples' checksums (tar_index.py) tell it as each is read instead.

    A pack's index (`source.packed`) is a promise about its shards: a shard of another size, or walked to other
    samples, is refused, naming it and how to pack again; shards of other mtimes and the same headers are kept, with
    a note of what that check cost. A cache of shards from elsewhere is the trainer's own: a changed shard is walked
    again (with checksums, where the index has them) and the index rebuilt from its walk and the others' entries,
    with a note naming it."""
    stats = [os.stat(p) for p in source.shards]
    resized = [k for k, stat in enumerate(stats) if stat.st_size != int(source.sizes[k])]
    touched = [k for k, stat in enumerate(stats) if k not in resized and stat.st_mtime_ns != int(source.mtimes[k])]
    if source.packed and resized:
        k = resized[0]
        raise UserError(f"shard {source.shards[k]} has {stats[k].st_size} bytes but its index {index} says "
                        f"{int(source.sizes[k])}: the shard was replaced or cut short after it was packed; "
                        f"{pack_again(index)}")
    if not resized and not touched:
        return source
    start = time.perf_counter()
    walked = {k: walk_shard(source.shards[k], source.role) for k in (*resized, *touched)}
    seconds = time.perf_counter() - start
    changed = [k for k in sorted(walked) if not walked[k].same_members(indexed_samples(source, k))]
    if source.packed:
        if changed:
            k = changed[0]
            raise UserError(f"shard {source.shards[k]} differs from its index {index} "
                            f"({first_difference(indexed_samples(source, k), walked[k])}): it was changed after it "
                            f"was packed; {pack_again(index)}")
        return replace(source, notes=(touched_note(source, len(touched), seconds),))
    if not changed:  # touched alone: the index holds, with the shards' mtimes of now
        return replace(source, sizes=np.array([stat.st_size for stat in stats], dtype=np.int64),
                       mtimes=np.array([stat.st_mtime_ns for stat in stats], dtype=np.int64), cached=False)
    k = changed[0]
    others = f" (and {len(changed) - 1} other shards)" if len(changed) > 1 else ""
    if source.checksums is not None:  # the rebuilt index keeps them: the changed shards' bytes are read for theirs
        walked = {j: walk_shard(source.shards[j], source.role, checksums=True) for j in changed}
    found = [walked[j] if j in changed else indexed_samples(source, j) for j in range(len(source.shards))]
    rebuilt = assemble(source.location, source.role, list(source.shards), found, classes)
    return replace(rebuilt, index=source.index,
                   notes=(f"shard {source.shards[k]}{others} changed since it was indexed: indexed again",))


def touched_note(source: TarShards, touched: int, seconds: float) -> str:
    """What a pack's shards of other mtimes and the same headers are, and what will tell."""
    tells = ("; each sample's checksum, compared as it is read, stops the run at a changed one"
             if source.checksums is not None else
             ", which this index cannot tell apart (it has no checksums: pack again to have them)")
    return (f"{touched} shards of {source.location} have other mtimes than its index records and the same members: a "
            f"copy that did not keep mtimes (`cp -a` or `rsync -a` keep them), or bytes changed in place{tells}; "
            f"checking their headers took {seconds:.1f} s")


def indexed_samples(source: TarShards, k: int) -> Found:
    """Shard k's samples as the index holds them."""
    lo, hi = np.searchsorted(source.shard, [k, k + 1]).tolist()
    return Found(source.offsets[lo:hi].tolist(), source.lengths[lo:hi].tolist(), source.labels[lo:hi].tolist(),
                 None if source.checksums is None else source.checksums[lo:hi].tolist())


def first_difference(indexed: Found, walked: Found) -> str:
    """What a shard's walk found that its index does not say, for the message."""
    if len(walked.labels) != len(indexed.labels):
        return f"{len(walked.labels)} samples, the index {len(indexed.labels)}"
    j = next(j for j in range(len(walked.labels)) if (walked.offsets[j], walked.lengths[j], walked.labels[j])
             != (indexed.offsets[j], indexed.lengths[j], indexed.labels[j]))
    if walked.labels[j] != indexed.labels[j]:
        return f"its sample {j} has label {walked.labels[j]}, the index {indexed.labels[j]}"
    return f"its sample {j} lies at bytes {walked.offsets[j]}+{walked.lengths[j]}, the index says " \
           f"{indexed.offsets[j]}+{indexed.lengths[j]}"


"""Where a split's tar shards are: a folder's `*.tar`, a brace or glob pattern, or the train or validation shards
of a folder that holds both side by side. Names only: nothing here opens a shard, so the walk (tar_walk.py) and the
registry's face (tar_shards.py) both build on it.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Optional

from imagenet_elastic.errors import UserError

_PATTERN_CHARS = "{*?["


def is_pattern(location: str) -> bool:
    """A brace or glob pattern of shards, or one shard, rather than a folder."""
    return any(c in location for c in _PATTERN_CHARS) or location.endswith(".tar")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace notation: `a-{000..003}.tar` counts with the first number's width (a-000.tar ...
    a-003.tar), `{x,y}` lists alternatives; several braces multiply."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[:match.start()], match.group(1), pattern[match.end():]
    counted = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if counted:
        first, last = counted.groups()
        items = [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    else:
        items = body.split(",")
    return [expanded for item in items for expanded in expand_braces(head + item + tail)]


def shard_paths(location: str, role: str) -> list[str]:
    """The shards of a split, in order: a folder's `*.tar` by name, or a pattern's expansion (each part globbed)."""
    if not is_pattern(location):
        paths = sorted(os.path.join(location, name) for name in os.listdir(location) if name.endswith(".tar"))
    else:
        paths = []
        for part in expand_braces(location):
            found = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
            if not found or not all(os.path.isfile(p) for p in found):
                missing = part if not found else next(p for p in found if not os.path.isfile(p))
                raise UserError(f"{role} shard {missing} does not exist (from {location})")
            paths.extend(found)
    if not paths:
        raise UserError(f"{role} data {location} holds no .tar shards")
    return paths



def split_patterns(folder: str) -> Optional[tuple[str, str]]:
    """Patterns of the train and val shards of a folder that holds both side by side, as timm's imagenet-1k-wds
    does (`imagenet1k-train-0000.tar` ... beside `imagenet1k-validation-00.tar` ...); None for a folder of one
    split's shards. A folder of both whose names do not tell every shard's split is refused."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
    except OSError:
        return None
    train = {n for n in names if "train" in n}
    for word in ("validation", "val"):
        val = {n for n in names if re.search(rf"(^|[-_.]){word}([-_.]|$)", n)}
        if not (train and val):
            continue
        unclear = [n for n in names if (n in train) == (n in val)]
        if unclear:
            raise UserError(f"{folder} holds train shards ({min(train - val or train)} ...) and {word} shards "
                            f"({min(val - train or val)} ...), and {unclear[0]}, whose name says "
                            f"{'both' if unclear[0] in train else 'neither'}: name each split's shards with a pattern "
                            f"({os.path.join(folder, '*train*.tar')}, {os.path.join(folder, f'*{word}*.tar')})")
        return os.path.join(folder, "*train*.tar"), os.path.join(folder, f"*{word}*.tar")
    return None


def split_location(location: str, role: str) -> str:
    """`location` itself, or this split's shards where it is a folder of train and validation shards side by side:
    a folder given as --val-path, or to `evaluate`, scores its validation shards alone."""
    both = None if is_pattern(location) else split_patterns(location)
    return location if both is None else both[0] if role == "train" else both[1]

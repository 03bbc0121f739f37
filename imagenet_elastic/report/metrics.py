"""metrics.jsonl: one JSON object per completed epoch, never duplicated across resumes."""

from __future__ import annotations

import json
import os
from typing import Any

from imagenet_elastic.checkpoint.atomic import atomic_write_bytes, storage_error

FILENAME = "metrics.jsonl"


def write(folder: str, history: list[dict[str, Any]]) -> None:
    """Rewrite the file from the checkpointed history (atomic; a few hundred bytes per epoch).

    Deriving the file from the checkpoint means a run killed between the two writes, or resumed
    from an older checkpoint, never repeats or loses an epoch's row.
    """
    data = "".join(json.dumps(row) + "\n" for row in history).encode()
    path = os.path.join(folder, FILENAME)
    try:
        atomic_write_bytes(data, path)
    except OSError as error:
        raise storage_error(error, "writing", path) from None


def read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

"""W&B's transaction log (run-ID.wandb), read as `wandb sync` reads it: the history rows an earlier start of a run
already sent, so that a resumed run sends no step twice."""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from collections.abc import Iterator
from typing import Any

# a 7-byte header, then LevelDB's log format (32 KiB blocks of records: crc32 of type and data, length, type, data)
# whose payloads are wandb's protobuf `Record`s. wandb >= 0.23 writes it from Go and ships no Python reader.
WANDB_HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def transaction_logs(wandb_dir: str, run_id: str) -> list[str]:
    """The transaction logs of run `run_id` in W&B's folder, one per start, oldest first (a start within the same
    second as an earlier one gets a `-1`, `-2`, ... suffix)."""
    folder = re.compile(rf"(?:offline-)?run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for name in os.listdir(wandb_dir) if os.path.isdir(wandb_dir) else ():
        started = folder.fullmatch(name)
        log = os.path.join(wandb_dir, name, f"run-{run_id}.wandb")
        if started and os.path.isfile(log):
            found.append(((started.group(1), int(started.group(2) or 0)), log))
    return [log for _, log in sorted(found)]


def wandb_records(path: str) -> Iterator[Any]:
    """The `Record`s of a W&B transaction log, up to the first torn or damaged one (a killed writer's last)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(WANDB_HEADER):
        return
    at, payload = len(WANDB_HEADER), b""
    while True:
        if BLOCK - at % BLOCK < 7:  # a block's tail too short for a record header is padding
            at += BLOCK - at % BLOCK
        if at + 7 > len(data):
            return
        checksum, length, kind = struct.unpack("<IHB", data[at:at + 7])
        body = data[at + 7:at + 7 + length]
        if len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) != checksum:
            return
        at += 7 + length
        payload = body if kind in (FULL, FIRST) else payload + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def wandb_history(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, {key: value}) of each history row a W&B transaction log holds."""
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            yield record.history.step.num, {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                            for item in items}

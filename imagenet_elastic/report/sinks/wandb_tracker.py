"""Weights & Biases (--wandb PROJECT): a tracker (tracker.py's rules), through W&B's own service process, so a row
never holds the training loop up; and W&B's transaction log (run-ID.wandb), read as `wandb sync` reads it: the
history rows an earlier start of a run already sent, so that a resumed run sends no step twice."""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
import zlib
from collections.abc import Iterator
from typing import Any, Optional

from imagenet_elastic.report.sinks.tracker import EPOCH_KEY, TRAIN_KEY, Tracker

# a 7-byte header, then LevelDB's log format (32 KiB blocks of records: crc32 of type and data, length, type, data)
# whose payloads are wandb's protobuf `Record`s. wandb >= 0.23 writes it from Go and ships no Python reader.
WANDB_HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32768
FULL, FIRST, LAST = 1, 2, 4  # a record whole, or its first and last part (MIDDLE, 3: a part between)


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


def wandb_history(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, {key: value}) of each history row of a W&B transaction log, up to the first torn or damaged record."""
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
        if kind not in (FULL, LAST):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            yield record.history.step.num, {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                            for item in record.history.item}


class WandbTracker(Tracker):
    """PROJECT (WANDB_ENTITY picks the team). Its files go to WANDB_DIR, else to the checkpoints folder, so that every
    restart finds the transaction logs of the run's earlier starts (`held`)."""

    option, package, metavar = "wandb", "wandb", "PROJECT"
    help = ("rank 0 also logs steps.jsonl's and metrics.jsonl's rows, the settings and the start-up table to this "
            "Weights & Biases project (`pip install \"imagenet_elastic[wandb]\"`; `WANDB_MODE=offline` keeps the run "
            "on disk for `wandb sync`); a restart, requeue or --resume continues the same run, without a step twice")
    NOT_IN_NAME = re.compile(r"[/\\#?%:]")  # W&B refuses these in a project's name

    def __init__(self, where: str, folder: str) -> None:
        super().__init__(where, folder)
        self.dir = os.environ.get("WANDB_DIR") or folder
        self.run: Any = None

    def new_id(self) -> str:
        return secrets.token_hex(4)  # W&B's ids are 8 characters of [a-z0-9]

    def check(self) -> None:
        if not self.where or self.NOT_IN_NAME.search(self.where):
            raise self.refuse("a W&B project name, without / \\ # ? % :")
        try:
            os.makedirs(os.path.join(self.dir, "wandb"), exist_ok=True)
        except OSError as error:
            raise self.refuse(f"cannot make W&B's folder in {self.dir}: {error.strerror or error}") from None
        if not os.access(self.dir, os.W_OK):
            raise self.refuse(f"cannot write W&B's folder {self.dir}")

    def open(self, run_id: Optional[str], name: str, settings: dict[str, Any]) -> str:
        import wandb

        # console="off": W&B would wrap stdout and stderr
        self.run = wandb.init(project=self.where, id=run_id, resume="allow", name=name,
                              dir=self.dir, settings=wandb.Settings(console="off", silent=True))
        self.run.config.update({"settings": settings}, allow_val_change=True)
        return self.run.id

    def held(self) -> dict[str, int]:
        last = {TRAIN_KEY: 0, EPOCH_KEY: 0}
        mine = os.path.realpath(os.path.dirname(self.run.dir))  # run.dir is the run folder's files/
        for path in transaction_logs(os.path.join(self.dir, "wandb"), self.run.id):
            if os.path.realpath(os.path.dirname(path)) == mine:  # this start's own log: nothing sent yet
                continue
            for step, values in wandb_history(path):
                last.update({key: max(held, step) for key, held in last.items() if key in values})
        return last

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def describe(self, facts: dict[str, str]) -> None:
        self.run.config.update({"startup": facts}, allow_val_change=True)

    def close(self, finished: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if finished else 1)
            self.run = None

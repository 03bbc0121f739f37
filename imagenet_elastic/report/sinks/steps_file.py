"""steps.jsonl: rank 0's step rows, one JSON object a line, the record every other sink catches up from. It continues
across kills, restarts and world-size changes without a duplicated or out-of-order step: at start every row beyond the
checkpoint's step is dropped (`trim`), and the resumed run logs those steps again."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import IO, Any, Callable, Optional

from imagenet_elastic.atomic_files import storage_error, store_bytes
from imagenet_elastic.report.metrics import is_number, json_line
from imagenet_elastic.report.sinks.base import Sink

FILENAME = "steps.jsonl"


def read_text(path: str) -> str:
    """The file's text; a byte that is not UTF-8 (damage) reads as U+FFFD, so that its line is kept or dropped as any
    other damaged line is (`whole_rows`), never the whole file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def whole_rows(text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, row) for each line that is a whole JSON object: a killed run's last line may be torn."""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            yield line, row


def kept_rows(text: str, last_step: int) -> list[str]:
    """The lines of a steps.jsonl whose step the checkpoint covers; a torn last line goes too."""
    return [line for line, row in whole_rows(text) if is_number(row.get("step")) and row["step"] <= last_step]


def trim(folder: str, last_step: int, warn: Callable[[str], None]) -> list[dict[str, Any]]:
    """Before the first step: drop rows beyond the step the run starts from; returns the rest (StorageError on I/O)."""
    path = os.path.join(folder, FILENAME)
    try:
        text = read_text(path)
    except FileNotFoundError:
        text = ""
    except OSError as error:
        raise storage_error(error, "reading", path) from None
    kept = kept_rows(text, last_step)
    # damage: a line before the last that is not blank and not a JSON object (any kill may tear the last: unsaid)
    damaged = [n for n, line in enumerate(text.splitlines()[:-1], 1) if line.strip() and not any(whole_rows(line))]
    if damaged:
        shown = ", ".join(map(str, damaged[:5])) + (f" and {len(damaged) - 5} more" if len(damaged) > 5 else "")
        warn(f"{path}: dropping {'lines' if len(damaged) > 1 else 'line'} {shown}, not JSON rows (damaged)")
    if kept != text.splitlines():
        store_bytes("".join(line + "\n" for line in kept).encode(), path)
    return [json.loads(line) for line in kept]


class StepsFile(Sink):
    """Appends each step row to steps.jsonl, opened at the first row, so a run that fails before it changes nothing
    on disk. A failed write (a full disk) ends this sink with one warning: the checkpoints say what it means."""

    def __init__(self, folder: str) -> None:
        self.name = self.path = os.path.join(folder, FILENAME)
        self.file: Optional[IO[str]] = None

    def step(self, row: dict[str, Any]) -> None:
        if self.file is None:
            self.file = open(self.path, "a")  # noqa: SIM115 (open for the whole run; closed in close())
        self.file.write(json_line(row))
        self.file.flush()

    def epoch(self, row: dict[str, Any]) -> None:
        """metrics.jsonl holds the epochs."""

    def close(self, finished: bool) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

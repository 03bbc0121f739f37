"""Which tracker run each experiment tracker continues across restarts, and CHECKPOINTS/trackers.json (PENDING), which
keeps a new run's id until a checkpoint does (tracker.py's first rule)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from imagenet_elastic.atomic_files import atomic_write_bytes

PENDING = "trackers.json"


class TrackerRuns:
    """Which tracker run each tracker continues, and what checkpoints save of them (`ids`: option -> run id)."""

    def __init__(self, folder: str, warn: Callable[[str], None]) -> None:
        self.path = os.path.join(folder, PENDING)
        self.warn = warn
        self.ids: dict[str, str] = {}
        self.saved: dict[str, str] = {}  # the checkpoint's
        self.pending: dict[str, Any] = {}  # PENDING's: option -> {"id", "from": the checkpoint's time stamp}
        self.started_from: Optional[float] = None

    def begin(self, saved: dict[str, str], continuing: bool, started_from: Optional[float]) -> None:
        """`saved`: the checkpoint's runs; `continuing`: this start continues the folder, so that a run PENDING holds
        from the same checkpoint (`started_from`) is continued."""
        self.saved, self.started_from = dict(saved), started_from
        self.pending = self.read_pending() if continuing else {}

    def earlier(self, option: str) -> Optional[str]:
        """The run to continue: the checkpoint's, else the one a start from this same point made and recorded."""
        if option in self.saved:
            return self.saved[option]
        earlier = self.pending.get(option)
        if isinstance(earlier, dict) and earlier.get("from") == self.started_from:
            return earlier.get("id")
        return None

    def made(self, option: str, run_id: str) -> None:
        """A run is made or continued: checkpoints save it from now on, PENDING until one does."""
        if option not in self.saved:
            self.record_pending(option, run_id)
        self.ids[option] = run_id

    def read_pending(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                found = json.load(f)
            return found if isinstance(found, dict) else {}
        except (OSError, ValueError):
            return {}

    def record_pending(self, option: str, run_id: str) -> None:
        if self.pending.get(option) != {"id": run_id, "from": self.started_from}:
            self.pending[option] = {"id": run_id, "from": self.started_from}
            atomic_write_bytes(json.dumps(self.pending).encode(), self.path)

    def forget_pending(self) -> None:
        """After a checkpoint that holds the runs' ids (the first of this start)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as error:
            self.warn(f"could not remove {self.path}: {error.strerror or error}")

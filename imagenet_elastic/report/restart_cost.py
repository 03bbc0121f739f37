"""What a restart cost, said once after its first step, part by part: the launcher noticing and
starting the process, imports, the build steps (the checkpoint's load among them), the first step
(and what compiling took of it). A user whose restarts are slow sees which part to look at."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional


def process_started_at() -> Optional[float]:
    """This process's start as a Unix time, from /proc (Linux), to 1/CLK_TCK; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


@dataclass(frozen=True)
class RestartCost:
    resumed_at: float  # the checkpoint's time stamp
    started: Optional[float]  # this process's start (None where unknown)
    began: float  # the build steps began: imports are done
    built: float  # training can start
    load_seconds: float  # reading (or, on ranks other than 0, mapping) the checkpoint

    def describe(self, stepped: float, compiled: Optional[str] = None) -> str:
        """`compiled`: what compiling took of the first step, and from which cache (compile.Compilation)."""
        parts = [f"process started {self.started - self.resumed_at:.1f} s after it, imports "
                 f"{self.began - self.started:.1f} s"] if self.started is not None else []
        parts += [f"build steps {self.built - self.began:.1f} s (checkpoint load {self.load_seconds:.2f} s)",
                  f"first step {stepped - self.built:.1f} s" + (f" ({compiled})" if compiled else "")]
        return f"first step {stepped - self.resumed_at:.1f} s after the checkpoint was written: " + ", ".join(parts)

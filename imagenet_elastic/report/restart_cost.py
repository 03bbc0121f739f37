"""What a restart cost, said once after its first step, part by part: the launcher noticing and
starting the process, imports, the build steps, and the first step (compiling, and the step itself, which no cache
shortens: on CUDA it includes cuDNN's autotuning), so a user sees which part a cache could remove."""

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
class FirstStep:
    """What the first step's time went on, as far as the run can tell."""

    compile_seconds: Optional[float] = None  # the first compiled call (tracing, compiling, one forward); None: eager
    compiled: str = ""  # how: "cold cache", "cache loaded from PATH: 2 of 2 Inductor graphs from it", a failure
    cache_load_seconds: Optional[float] = None  # reading the compile cache file into torch's caches (a build step)
    autotuned: bool = False  # cuDNN timed its algorithms for each new shape (cudnn.benchmark): in the step itself

    def describe(self, seconds: float) -> str:
        """The first step's `seconds`, and what they went on."""
        autotuning = ", with cuDNN's autotuning, which no cache keeps" if self.autotuned else ""
        if self.compile_seconds is None:
            return f"first step {seconds:.1f} s" + (f" (eager{autotuning})" if autotuning else "")
        return (f"first step {seconds:.1f} s (compile {self.compile_seconds:.1f} s, {self.compiled}; the step itself "
                f"{max(seconds - self.compile_seconds, 0.0):.1f} s{autotuning})")


@dataclass(frozen=True)
class RestartCost:
    resumed_at: float  # the checkpoint's time stamp
    started: Optional[float]  # this process's start (None where unknown)
    began: float  # the build steps began: imports are done
    built: float  # training can start
    load_seconds: float  # reading (or, on ranks other than 0, mapping) the checkpoint

    def describe(self, stepped: float, first: FirstStep = FirstStep()) -> str:
        parts = [f"process started {self.started - self.resumed_at:.1f} s after it, imports "
                 f"{self.began - self.started:.1f} s"] if self.started is not None else []
        cache = f", compile cache load {first.cache_load_seconds:.2f} s" if first.cache_load_seconds is not None else ""
        parts += [f"build steps {self.built - self.began:.1f} s (checkpoint load {self.load_seconds:.2f} s{cache})",
                  first.describe(stepped - self.built)]
        return f"first step {stepped - self.resumed_at:.1f} s after the checkpoint was written: " + ", ".join(parts)

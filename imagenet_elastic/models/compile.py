"""torch.compile for the training step: on by default on CUDA, where it pays for its compile time, with a cache beside
the checkpoints (compile_cache.py); off on CPUs, where it is slower (docs/BENCHMARKS.md). A model that cannot compile
trains eager, with one warning."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from imagenet_elastic.errors import first_line
from imagenet_elastic.launch import distributed
from imagenet_elastic.models.compile_cache import CompileCache
from imagenet_elastic.report.restart_cost import FirstStep

BACKEND: Any = "inductor"  # torch.compile's backend; tests put a stub here (inductor is slow on CPUs: BENCHMARKS.md)
TRITON_MIN_CAPABILITY = (7, 0)  # older GPUs: "Triton only supports devices of CUDA Capability >= 7.0"


def compile_choice(setting: Optional[bool], device_type: str,
                   capability: Optional[tuple[int, int]] = None) -> tuple[bool, str]:
    """Whether the training step compiles, and why: a setting wins; unset, on CUDA where Triton supports the GPU."""
    if setting is not None:
        return setting, "--compile" if setting else "--no-compile"
    if device_type != "cuda":
        return False, f"{device_type.upper()} default"
    if capability is not None and capability < TRITON_MIN_CAPABILITY:
        return False, f"CUDA default, but this GPU (sm_{capability[0]}{capability[1]}) is older than Triton supports"
    return True, "CUDA default"


def error_line(error: BaseException) -> str:
    """What went wrong, in one line: the backend's own error rather than dynamo's `backend='inductor' raised:`."""
    inner = getattr(error, "inner_exception", None) or error
    return f"{type(inner).__name__}: {first_line(inner)}"


def backward_compiled_with_forward() -> Any:
    """Compile the backward with the forward, not at first use: its failures surface in that call (before DDP or the
    loss wait for a backward), its time in that measure. No-op without this private switch."""
    from torch._functorch import config

    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def graph_cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache (hits, misses) so far in this process; (0, 0) with another backend."""
    from torch._dynamo.utils import counters

    counted = counters.get("inductor", {})
    return int(counted.get("fxgraph_cache_hit", 0)), int(counted.get("fxgraph_cache_miss", 0))


def undoer(model: nn.Module) -> Callable[[], None]:
    """Puts back what a failed first compiled call changed (at a graph break the graph before it ran: batch norm
    statistics, random draws), so the eager retry starts as an eager run would."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None

    @torch.no_grad()
    def undo() -> None:
        for buffer, saved in buffers:
            buffer.copy_(saved)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
    return undo


class CompiledOrEager(nn.Module):
    """`model` compiled, unless its first call fails to compile: that call retries eager from its starting state
    (`undoer`), later ones stay eager. Inside DDP, whose reducer awaits a backward only after a forward returned, so
    never sees the failure. Other errors fail the eager retry too, as do failed later recompilations (a new shape);
    an out-of-memory error is raised, and the next call compiles again."""

    def __init__(self, model: nn.Module, backend: Any = None) -> None:
        super().__init__()
        self.compiled = torch.compile(model, backend=backend or BACKEND)  # holds `model` as _orig_mod: one copy
        self.called = False
        self.failure: Optional[str] = None  # error_line of the failed compile
        self.compile_seconds: Optional[float] = None  # the first call: tracing and compiling, forward and backward
        self.graphs_cached: tuple[int, int] = (0, 0)  # of the first call's graphs: from Inductor's cache, all of them

    @property
    def eager(self) -> nn.Module:
        """The model: the wrapper's `_orig_mod`, or with dynamo off (TORCHDYNAMO_DISABLE=1) the model itself."""
        return getattr(self.compiled, "_orig_mod", self.compiled)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:
            return self.eager(*args, **kwargs)
        if self.called:
            return self.compiled(*args, **kwargs)
        self.called = True
        undo = undoer(self.eager)
        start, (hits, misses) = time.perf_counter(), graph_cache_counts()
        try:
            with backward_compiled_with_forward():
                out = self.compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            # the device's, not the compiler's: --micro-batch auto redoes the step, whose first call compiles again
            self.called = False
            raise
        except Exception as error:
            self.compile_seconds, self.failure = time.perf_counter() - start, error_line(error)
            undo()
            return self.eager(*args, **kwargs)
        self.compile_seconds = time.perf_counter() - start
        now_hits, now_misses = graph_cache_counts()
        self.graphs_cached = (now_hits - hits, now_hits - hits + now_misses - misses)
        return out


class Compilation:
    """The run's torch.compile: decided once, the model wrapped, the outcome said after the first step, cache kept."""

    def __init__(self, enabled: bool, reason: str, model_name: str, cache: Optional[CompileCache],
                 warn: Callable[[str], None], is_main: bool) -> None:
        self.enabled, self.reason, self.model_name = enabled, reason, model_name
        self.cache = cache  # None where it does not compile
        self.warn, self.is_main = warn, is_main
        self.module: Optional[CompiledOrEager] = None

    def wrap(self, model: nn.Module) -> nn.Module:
        if not self.enabled:
            return model
        self.module = CompiledOrEager(model)
        return self.module

    def after_first_step(self) -> None:
        """Every rank (one gather of a line or None): rank 0 says which ranks could not compile, then keeps the
        caches its own compile filled, so a restart starts warm."""
        if self.module is None:
            return
        failures = distributed.all_gather_object(self.module.failure)
        failed = [rank for rank, line in enumerate(failures) if line is not None]
        if failed and self.is_main:
            some = len(failed) < len(failures)
            where = f" on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}" if some else ""
            self.warn(f"could not compile {self.model_name}{where} ({failures[failed[0]]}); training goes on eager"
                      f"{' there' if some else ''} (--no-compile skips the attempt)")
        write = self.cache_write()
        if write is not None:
            write()

    def cache_write(self) -> Optional[Callable[[], None]]:
        """Rank 0's write of the cache file where this process compiled graphs it lacks, or None: collected now, in
        the thread where torch compiles, written by the returned call anywhere (the checkpoint writer's thread)."""
        module = self.module
        if self.cache is None or not self.is_main or module is None or not module.called or module.failure is not None:
            return None
        data = self.cache.collect()
        return None if data is None else functools.partial(self.cache.write, data)

    def describe(self) -> str:
        """The start-up table's words: on or off and why, and the cache file's state."""
        text = f"{'on' if self.enabled else 'off'}: {self.reason}"
        return text + (f"; compile cache {self.cache.state}" if self.cache is not None else "")

    def first_step(self, autotuned: bool = False) -> FirstStep:
        """The restart line's account of the first step: cache load, compile time, Inductor cache hits, a warm
        cache; `autotuned`: cuDNN timed its algorithms in it (cudnn.benchmark on CUDA), which no cache keeps."""
        cache_load = self.cache.load_seconds if self.cache is not None else None
        module = self.module
        if module is None or module.compile_seconds is None:
            return FirstStep(cache_load_seconds=cache_load, autotuned=autotuned)
        if module.failure is not None:
            how = "failed, eager"
        else:
            hits, graphs = module.graphs_cached
            warm = self.cache is not None and self.cache.loaded
            how = (f"cache loaded from {self.cache.path}" if warm else "cold cache") + (
                f": {hits} of {graphs} Inductor graphs from the caches" if graphs else "")
        return FirstStep(module.compile_seconds, how, cache_load, autotuned)

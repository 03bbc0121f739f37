"""What recompiles a compiled training run: the real training loop, its model compiled by AOTAutograd (the `aot_eager`
backend: the graphs inductor would get, without its C++ compiling, slow on these CPUs), each compile counted by
dynamo's compile id as the backend receives it.

A cold recompile costs as much as the first compile (docs/BENCHMARKS.md): a run compiles one graph, and only a
micro-batch of a new size makes another. The second size (micro-batches of unequal sizes in a step, or halved by
--micro-batch auto) recompiles once, with the batch dimension symbolic (dynamo's automatic dynamic shapes), and that
graph takes every later size (but 1, which dynamo specializes): two graphs at most for one image size. Marking the
batch dynamic from the start would spare that one recompile at the cost of every run's graph being the general one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch
from conftest import MIXED, SMALL_RUN
from inprocess import in_memory, train
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

from imagenet_elastic.models import compile as compiling
from imagenet_elastic.models.compile import CompiledOrEager
from imagenet_elastic.train import step as step_module

RUN = [*SMALL_RUN, "--workers", "0", "--threads", "1", "--max-steps-per-epoch", "3", "--no-tensorboard", "--compile"]
ACCUMULATING = ["--global-batch-size", "8", "--batch-size", "4"]  # two micro-batches a step
SPLITS = in_memory()


class Graphs:
    """What dynamo compiled, by compile (`0/0` the frame's first, `0/1` its first recompile, ...): whether its graphs
    take a size as an input (a dynamic shape); and why each recompile happened (dynamo's recompile log)."""

    def __init__(self) -> None:
        self.compiles: dict[str, bool] = {}
        self.reasons: list[str] = []

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compile_id = str(torch._guards.CompileContext.current_compile_id())
        self.compiles[compile_id] = self.compiles.get(compile_id, False) or any(
            isinstance(node.meta.get("example_value"), torch.SymInt) for node in gm.graph.find_nodes(op="placeholder"))
        return aot_eager(gm, example_inputs)

    @property
    def count(self) -> int:
        return len(self.compiles)

    @property
    def symbolic(self) -> list[bool]:
        return list(self.compiles.values())

    @contextlib.contextmanager
    def recording_reasons(self) -> Iterator[None]:
        log = logging.getLogger("torch._dynamo.guards.__recompiles")
        handler = logging.Handler()
        handler.emit = lambda record: self.reasons.append(record.getMessage())  # type: ignore[method-assign]
        torch._logging.set_logs(recompiles=True)
        log.addHandler(handler)
        try:
            yield
        finally:
            log.removeHandler(handler)
            torch._logging.set_logs()


@pytest.fixture
def graphs(monkeypatch) -> Iterator[Graphs]:
    counted = Graphs()
    monkeypatch.setattr(compiling, "BACKEND", counted.backend)
    torch._dynamo.reset()
    with counted.recording_reasons():
        yield counted
    torch._dynamo.reset()


def trained(tmp_path, argv: list[str]) -> None:
    train(["DATA", *RUN, *argv, "--checkpoints-path", str(tmp_path / "run")], splits=SPLITS)


CASES = {  # each accumulates (two micro-batches a step) and trains two epochs: validation between them runs eager
    "gradient accumulation": [],
    "--model-ema": ["--model-ema"],
    "mixup, cutmix and drop path": MIXED,
    "--no-channels-last": ["--no-channels-last"],
    "bf16 autocast on the CPU": ["--amp", "bf16"],
}


@pytest.mark.parametrize("case", CASES)
def test_an_accumulating_compiled_run_compiles_one_graph_and_never_again(tmp_path, graphs, case):
    trained(tmp_path, [*ACCUMULATING, "--epochs", "2", *CASES[case]])
    assert graphs.count == 1, graphs.reasons


def test_micro_batches_of_two_sizes_compile_one_graph_more_whose_batch_is_symbolic(tmp_path, graphs):
    """8 images as 3 + 3 + 2: the second size recompiles once, with a symbolic batch; no third graph."""
    trained(tmp_path, ["--global-batch-size", "8", "--batch-size", "3", "--epochs", "1"])
    assert graphs.symbolic == [False, True], graphs.reasons
    assert len(graphs.reasons) == 1 and "size mismatch at index 0. expected 3, actual 2" in graphs.reasons[0]


def test_halving_the_micro_batch_under_auto_recompiles_once(tmp_path, graphs, monkeypatch):
    """--micro-batch auto's halving (an out-of-memory error in the third step's first forward, raised outside the
    compiled graph as the device's would be) costs one recompile, for the halved size; nothing else recompiles."""
    forward, calls = CompiledOrEager.forward, []

    def running_out_at_the_third_step(self, images, *args, **kwargs):
        calls.append(images.shape[0])
        if len(calls) > 4 and images.shape[0] > 4:  # steps 1 and 2 (two micro-batches of 8 each) fit
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 images (injected)")
        return forward(self, images, *args, **kwargs)

    monkeypatch.setattr(CompiledOrEager, "forward", running_out_at_the_third_step)
    trained(tmp_path, ["--global-batch-size", "16", "--batch-size", "8", "--micro-batch", "auto", "--epochs", "1"])
    assert calls[:9] == [8, 8, 8, 8, 8, 4, 4, 4, 4]  # the third step redone in four micro-batches of 4
    assert graphs.symbolic == [False, True], graphs.reasons
    assert len(graphs.reasons) == 1 and "expected 8, actual 4" in graphs.reasons[0]


@contextlib.contextmanager
def momentum_zeroed(stats: step_module.RunningStats) -> Iterator[None]:
    """The way the later micro-batches once left the running statistics alone: momentum 0 meanwhile."""
    saved = [m.momentum for m in stats.batch_norms]
    for m in stats.batch_norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum in zip(stats.batch_norms, saved):
            m.momentum = momentum


def test_the_audit_sees_a_recompile_planted_by_a_module_attribute_written_between_micro_batches(tmp_path, graphs,
                                                                                                 monkeypatch):
    """The audit's own check: the momentum written back in for the later micro-batches, it counts the second graph
    and names the guard that failed."""
    monkeypatch.setattr(step_module.RunningStats, "frozen", momentum_zeroed)
    trained(tmp_path, [*ACCUMULATING, "--epochs", "1"])
    assert graphs.count == 2, graphs.reasons
    assert len(graphs.reasons) == 1 and ".momentum == 0.1" in graphs.reasons[0]


def test_frozen_running_statistics_are_bitwise_those_of_the_first_micro_batch_also_when_compiled():
    """The compiled forward updates batch norm's buffers in its graph; the later micro-batches' updates are undone
    to the bit, as in eager (tests/train/test_accumulation.py checks the eager step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 5))
    compiled = CompiledOrEager(model, backend=aot_eager)
    stats = step_module.RunningStats([model[1]])
    first, later = torch.randn(6, 3, 4, 4), torch.randn(6, 3, 4, 4)
    compiled(first).sum().backward()
    after_first = [b.clone() for b in stats.buffers()]
    with stats.frozen():
        compiled(later).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(stats.buffers(), after_first))
    assert model[1].momentum == 0.1

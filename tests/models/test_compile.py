"""--compile: on CUDA by default and off on CPUs, explicit settings winning; a model that cannot compile trains eager
after one warning, under DDP too; torch's compile caches kept beside the checkpoints, loaded only when they match,
a damaged file one warning; what compiling cost, in the start-up table and the restart line.

Real inductor compiles take 20-60 s on these CPUs: here dynamo traces for real, with the `eager` backend or one that
fails, and torch's Mega-Cache calls are replaced by stand-ins that keep what they are given. The real round trip, a
small model compiled by inductor in three processes with empty local caches, is the one `slow` test at the end
(tests/system/test_training.py compiles test_resnet once)."""

from __future__ import annotations

import gc
import importlib
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from compiled_small import small_model
from conftest import (
    REPO,
    SMALL_RUN,
    assert_names,
    child_env,
    compiled_run,
    load_checkpoint,
    restart_cost,
    single_line,
)
from inprocess import command
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imagenet_elastic import cli
from imagenet_elastic.config import Config
from imagenet_elastic.config.yaml_file import read_settings, settings_yaml
from imagenet_elastic.errors import UserError
from imagenet_elastic.models import compile as compiling
from imagenet_elastic.models import compile_cache
from imagenet_elastic.models.compile import Compilation, CompiledOrEager, compile_choice
from imagenet_elastic.models.compile_cache import FILE_NAME, CompileCache, decode, encode

RUN = [*SMALL_RUN, "--workers", "0", "--threads", "1", "--epochs", "1", "--max-steps-per-epoch", "2"]


def cannot_compile(gm, example_inputs):
    raise RuntimeError("no compiler here\nits second line")


# ----------------------------------------------------------------------------- the choice


def test_compile_is_on_on_cuda_and_off_on_cpu_unless_a_setting_says_otherwise():
    assert compile_choice(None, "cuda", (9, 0)) == (True, "CUDA default")
    assert compile_choice(None, "cpu") == (False, "CPU default")
    assert compile_choice(True, "cpu") == (True, "--compile")
    assert compile_choice(False, "cuda", (9, 0)) == (False, "--no-compile")
    on_a_p100 = compile_choice(None, "cuda", (6, 0))
    assert on_a_p100[0] is False and "sm_60" in on_a_p100[1]


def test_compile_is_unset_until_the_command_line_or_a_config_file_sets_it(tmp_path):
    parse = cli.parse
    assert parse(["/data"])[0].compile is None
    assert parse(["/data", "--compile"])[0].compile is True
    assert parse(["/data", "--no-compile"])[0].compile is False
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("compile: false\n")
    assert parse(["/data", "--config", str(recipe)])[0].compile is False
    assert parse(["/data", "--config", str(recipe), "--compile"])[0].compile is True
    saved = tmp_path / "saved.yaml"  # a run's config.yaml keeps "unset" unset: `compile: null`
    saved.write_text(settings_yaml(Config(data="/data")))
    assert read_settings(str(saved), cli.build_parser())["compile"] is None


def test_a_resume_with_another_compile_setting_is_no_difference():
    assert Config(data="/d", compile=True).differences(Config(data="/d").to_dict()) == []
    assert Config(data="/d", compile=False).differences(Config(data="/d", compile=True).to_dict()) == []


# ----------------------------------------------------------------------------- eager when it cannot compile


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_model_that_cannot_compile_runs_eager_from_its_first_call(fresh_dynamo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    wrapped = CompiledOrEager(model, backend=cannot_compile)
    x = torch.randn(5, 3)
    torch.testing.assert_close(wrapped(x), model(x))
    assert wrapped.failure == "RuntimeError: no compiler here" and wrapped.compile_seconds is not None
    wrapped(x).sum().backward()  # and on, eager
    assert model[0].weight.grad is not None


def test_with_dynamo_switched_off_the_model_runs_as_it_is(fresh_dynamo, monkeypatch):
    """TORCHDYNAMO_DISABLE=1, a common debugging switch, makes torch.compile hand the model back unwrapped (no
    `_orig_mod`): the compiled model's first call must not depend on the wrapper being there."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    model = nn.Linear(3, 4)
    wrapped = CompiledOrEager(model, backend=cannot_compile)
    x = torch.randn(5, 3)
    torch.testing.assert_close(wrapped(x), model(x))
    assert wrapped.eager is model and wrapped.failure is None


@pytest.mark.skipif(not hasattr(importlib.import_module("torch._functorch.config"), "force_non_lazy_backward_lowering"),
                    reason="this torch compiles the backward at its first use only")
def test_a_backward_that_cannot_compile_fails_the_first_call_not_the_backward(fresh_dynamo):
    """AOTAutograd would compile the backward graph at the first backward, after DDP and the loss have their
    forward: it is compiled with the forward instead, so its failure falls back like the forward's."""
    from torch._dynamo.backends.common import aot_autograd

    def no_backward(gm, example_inputs):
        raise RuntimeError("no backward compiler")

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapped = CompiledOrEager(model, backend=aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=no_backward))
    wrapped(torch.randn(5, 3)).sum().backward()
    assert wrapped.failure == "RuntimeError: no backward compiler" and model[0].weight.grad is not None


class BreakBetween(nn.Module):
    """Batch norm and dropout, then a graph break, then a layer whose graph fails to compile."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop, self.head = nn.BatchNorm1d(3), nn.Dropout(0.5), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(x))
        torch._dynamo.graph_break()
        return self.head(x)


def test_a_failed_compile_leaves_no_trace_of_the_graph_that_ran_before_it(fresh_dynamo):
    """The graph before a graph break runs before the next one compiles: its batch-norm update and random draws
    are undone, so the eager retry computes what an eager run would have."""
    graphs = []

    def second_graph_fails(gm, example_inputs):
        graphs.append(gm)
        if len(graphs) == 2:
            raise RuntimeError("no compiler for the second graph")
        return gm.forward

    torch.manual_seed(0)
    model, reference = BreakBetween(), BreakBetween()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(6, 3)
    torch.manual_seed(1)
    out = CompiledOrEager(model, backend=second_graph_fails)(x)
    torch.manual_seed(1)
    expected = reference(x)
    assert len(graphs) == 2  # the first graph compiled and ran
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean)
    assert model.norm.num_batches_tracked.item() == 1


def test_under_ddp_a_model_that_cannot_compile_trains_like_the_eager_one(fresh_dynamo, tmp_path):
    """DDP wraps the fallback: it never sees the failed first call, and the gradients it reduces are eager's."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        reference = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        reference.load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(CompiledOrEager(model, backend=cannot_compile))
        x = torch.randn(5, 3)
        for _ in range(2):
            for m in (ddp, reference):
                m.zero_grad()
                m(x).square().sum().backward()
            for ours, theirs in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(ours.grad, theirs.grad)
        assert ddp.module.failure is not None
        del ddp  # DDP's reducer holds the group: gone (and collected) before it, or gloo's threads may hang at exit
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_rank_0_says_which_ranks_could_not_compile_when_not_all_could(monkeypatch):
    warned = []
    compilation = Compilation(True, "CUDA default", "resnet50", None, warned.append, is_main=True)
    compilation.module = SimpleNamespace(failure=None, called=True)
    monkeypatch.setattr(compiling.distributed, "all_gather_object",
                        lambda line: [line, "RuntimeError: no triton", None, "RuntimeError: no triton"])
    compilation.after_first_step()
    assert len(warned) == 1, warned  # said once, by rank 0: the model, the ranks that failed and why, the way out
    assert_names(single_line(warned[0]), "resnet50", "ranks 1, 3", "(RuntimeError: no triton)", "eager", "--no-compile")


def test_a_run_whose_model_cannot_compile_warns_once_trains_and_checkpoints(image_folder, tmp_path, monkeypatch,
                                                                             fresh_dynamo):
    monkeypatch.setattr(compiling, "BACKEND", cannot_compile)
    result = command([str(image_folder), *RUN, "--compile", "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, result.stderr  # once: the model, the error, eager, and the flag that skips the attempt
    assert_names(warnings[0], "test_resnet", "(RuntimeError: no compiler here)", "eager", "--no-compile")
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 2
    assert not (tmp_path / FILE_NAME).exists()  # nothing compiled, nothing to keep


# ----------------------------------------------------------------------------- the cache file


class FakeMegaCache:
    """torch.compiler's save_cache_artifacts and load_cache_artifacts, as stand-ins: `save` returns what `artifacts`
    holds now (as torch does: the process's whole collection, None when empty), `load` records what it got."""

    def __init__(self) -> None:
        self.artifacts: dict[str, list[str]] = {}
        self.loaded: list[bytes] = []

    def save(self):
        if not self.artifacts:
            return None
        blob = repr(sorted(self.artifacts.items())).encode()
        return blob, SimpleNamespace(artifacts=defaultdict(list, self.artifacts))

    def load(self, blob: bytes):
        self.loaded.append(blob)
        return SimpleNamespace(artifacts=defaultdict(list))  # torch's CacheInfo of what it loaded; None: nothing


@pytest.fixture
def mega_cache(monkeypatch) -> FakeMegaCache:
    fake = FakeMegaCache()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load)
    return fake


KEY = {"torch": "2.13.0", "model": "resnet50", "precision": "bf16"}


def test_a_cache_file_is_its_header_then_torchs_blob_checked_whole():
    data = encode(KEY, b"torch's bytes", ["inductor:a"])
    header, blob = decode(data)
    assert (header["key"], header["artifacts"], blob) == (KEY, ["inductor:a"], b"torch's bytes")
    for damaged, why in ((data[:-1], "checksum"), (data.replace(b"{", b"[", 1), "header"),
                         (b"PK\x03\x04" + data, "not a compile cache")):
        with pytest.raises(ValueError, match=why):
            decode(damaged)


def test_rank_0_writes_the_cache_when_torch_holds_graphs_the_file_lacks(tmp_path, mega_cache):
    warned = []
    cache = CompileCache(str(tmp_path), KEY, warned.append)
    assert cache.collect() is None  # nothing compiled yet
    mega_cache.artifacts = {"inductor": ["a"], "aot_autograd": ["b"]}
    cache.write(cache.collect())
    assert cache.collect() is None  # nothing new since
    mega_cache.artifacts["inductor"].append("c")  # a recompilation
    cache.write(cache.collect())
    header, blob = decode((tmp_path / FILE_NAME).read_bytes())
    assert header["key"] == KEY and header["artifacts"] == ["aot_autograd:b", "inductor:a", "inductor:c"]
    restarted = CompileCache(str(tmp_path), KEY, warned.append)
    restarted.load()
    assert restarted.loaded and mega_cache.loaded == [blob] and warned == []
    assert restarted.collect() is None  # a warm start: the same graphs came out of the loaded caches


def test_a_cache_written_for_other_settings_is_left_unread_and_then_replaced(tmp_path, mega_cache):
    (tmp_path / FILE_NAME).write_bytes(encode({**KEY, "torch": "2.11.0"}, b"old", ["inductor:z"]))
    cache = CompileCache(str(tmp_path), KEY, pytest.fail)
    cache.load()
    assert not cache.loaded and mega_cache.loaded == []
    assert cache.state == f"{tmp_path / FILE_NAME} ignored: written for torch 2.11.0, now 2.13.0"
    mega_cache.artifacts = {"inductor": ["z"]}
    cache.write(cache.collect())  # this run's graphs, under this run's key
    assert decode((tmp_path / FILE_NAME).read_bytes())[0]["key"] == KEY


def test_a_damaged_or_unreadable_cache_is_one_warning_and_a_cold_compile(tmp_path, mega_cache):
    path = tmp_path / FILE_NAME
    path.write_bytes(encode(KEY, b"whole", [])[:-2])
    warned = []
    cache = CompileCache(str(tmp_path), KEY, warned.append)
    cache.load()
    assert len(warned) == 1, warned  # one warning: the file, and what is wrong with it
    assert_names(single_line(warned[0]), path, "checksum")
    assert not cache.loaded and mega_cache.loaded == [] and "unreadable" in cache.state
    path.unlink()
    path.mkdir()  # a read the OS refuses
    CompileCache(str(tmp_path), KEY, warned.append).load()
    assert len(warned) == 2 and "Is a directory" in warned[1]


def test_a_blob_torch_cannot_read_back_is_not_loaded_and_is_one_warning_without_torchs_traceback(tmp_path, capfd):
    """A whole file (its checksum right) whose blob torch's own reader rejects: torch.compiler.load_cache_artifacts
    logs a traceback and returns None (torch/compiler/_cache.py); that is no loaded cache, and one line."""
    path = tmp_path / FILE_NAME
    path.write_bytes(encode(KEY, b"not what torch.compiler.save_cache_artifacts wrote", ["inductor:a"]))
    warned = []
    cache = CompileCache(str(tmp_path), KEY, warned.append)
    cache.load()
    assert not cache.loaded and cache.state == f"{path} unreadable, ignored" and cache.known == frozenset()
    assert len(warned) == 1 and warned[0].startswith(f"ignoring the compile cache {path} (torch could not read it: ")
    assert warned[0].endswith("): compiling from scratch; rewritten once this run has compiled")
    assert "Traceback" not in capfd.readouterr().err
    compilation = Compilation(True, "--compile", "m", cache, pytest.fail, True)
    compilation.module = SimpleNamespace(compile_seconds=3.0, failure=None, graphs_cached=(0, 2))
    assert compilation.first_step().compiled == "cold cache: 0 of 2 Inductor graphs from the caches"


def test_the_first_step_counts_no_cached_graphs_where_torch_counts_none(monkeypatch):
    """Another backend, or a torch without Inductor's cache counters: the restart line leaves the count out."""
    monkeypatch.setattr(torch._dynamo.utils, "counters", {})
    assert compiling.graph_cache_counts() == (0, 0)
    compilation = Compilation(True, "--compile", "m", None, pytest.fail, True)
    compilation.module = SimpleNamespace(compile_seconds=3.0, failure=None, graphs_cached=(0, 0))
    assert compilation.first_step().compiled == "cold cache"


def test_a_refused_cache_write_is_one_warning_and_never_tried_again(tmp_path, mega_cache):
    warned = []
    cache = CompileCache(str(tmp_path / "gone"), KEY, warned.append)
    mega_cache.artifacts = {"inductor": ["a"]}
    cache.write(cache.collect())
    assert len(warned) == 1 and "could not write the compile cache" in warned[0]
    mega_cache.artifacts["inductor"].append("b")
    assert cache.collect() is None and len(warned) == 1


def test_a_torch_without_the_mega_cache_compiles_without_a_cache_file(tmp_path, monkeypatch):
    monkeypatch.delattr(torch.compiler, "save_cache_artifacts")
    cache = CompileCache(str(tmp_path), KEY, pytest.fail)
    cache.load()
    assert cache.state.startswith("unsupported by torch") and cache.collect() is None
    described = Compilation(True, "--compile", "m", cache, pytest.fail, True).describe()
    # compiling, asked by --compile; no cache, as this torch (its version) lacks the function that saves one
    assert_names(single_line(described), "on", "--compile", "unsupported", torch.__version__,
                 "torch.compiler.save_cache_artifacts")


# ----------------------------------------------------------------------------- in a run


def table_row(stdout: str) -> str:
    return re.search(r"channels_last / compile +(.*)", stdout).group(1)


def test_a_compiled_run_keeps_its_caches_and_its_restart_loads_them_and_says_so(image_folder, tmp_path, monkeypatch,
                                                                                 mega_cache, fresh_dynamo):
    """The cache file is written after the first step, every rank of the restart loads it before compiling, and the
    restart line says what compiling took and that it was warm. The compile runs dynamo for real (`eager` backend);
    the artifacts torch would have collected are the stand-in's."""
    monkeypatch.setattr(compiling, "BACKEND", "eager")
    mega_cache.artifacts = {"inductor": ["graph"]}
    args = [str(image_folder), *RUN, "--compile", "--checkpoints-path", str(tmp_path), "--resume"]
    first = command(args)
    assert first.returncode == 0, first.stderr
    assert table_row(first.stdout) == "True / on: --compile; compile cache none yet"
    header, blob = decode((tmp_path / FILE_NAME).read_bytes())
    assert header["key"]["model"] == "test_resnet" and header["key"]["device"] == "cpu"
    assert header["artifacts"] == ["inductor:graph"]
    torch._dynamo.reset()
    resumed = command([*args, "--epochs", "2"])
    assert resumed.returncode == 0, resumed.stderr
    assert table_row(resumed.stdout) == f"True / on: --compile; compile cache loaded from {tmp_path / FILE_NAME}"
    assert mega_cache.loaded == [blob]
    line, cost = restart_cost(resumed.stdout)  # the parts add up (restart_cost checks it)
    assert {"checkpoint load", "compile cache load", "compile", "the step itself"} <= cost.keys(), line
    assert_names(line, "compile", tmp_path / FILE_NAME, "the step itself")  # compiled from the cache it loaded
    assert "cold cache" not in line
    assert "compile" not in first.stderr + resumed.stderr  # no warning of it (the one warning: epochs 1 -> 2)


def test_graphs_compiled_after_the_first_step_reach_the_file_with_the_next_checkpoint(image_folder, tmp_path,
                                                                                      monkeypatch, mega_cache,
                                                                                      fresh_dynamo):
    """The first graph reaches the file after the first step, before any checkpoint; progressive resizing's second
    size compiles a second graph in epoch 2, which reaches it with that epoch's checkpoint; epoch 1's checkpoint,
    after no new graph, rewrote nothing."""
    graphs = []

    def counted(gm, example_inputs):
        graphs.append(gm)
        mega_cache.artifacts = {"inductor": [f"graph{i}" for i in range(len(graphs))]}
        return gm.forward

    writes = []
    write = CompileCache.write
    monkeypatch.setattr(CompileCache, "write", lambda cache, data: (
        writes.append(((tmp_path / "last.pt").exists(), decode(data)[0]["artifacts"])), write(cache, data)))
    monkeypatch.setattr(compiling, "BACKEND", counted)
    args = [str(image_folder), *RUN, "--compile", "--checkpoints-path", str(tmp_path), "--epochs", "2",
            "--progressive-resize", "32,64", "--progressive-epochs", "0,1"]
    result = command(args)
    assert result.returncode == 0, result.stderr
    assert len(graphs) == 2
    assert writes == [(False, ["inductor:graph0"]), (True, ["inductor:graph0", "inductor:graph1"])]
    assert decode((tmp_path / FILE_NAME).read_bytes())[0]["artifacts"] == writes[-1][1]


def test_a_damaged_cache_file_costs_a_warning_not_the_run_nor_its_checkpoints(image_folder, tmp_path, monkeypatch,
                                                                               mega_cache, fresh_dynamo):
    monkeypatch.setattr(compiling, "BACKEND", "eager")
    args = [str(image_folder), *RUN, "--checkpoints-path", str(tmp_path), "--resume"]
    assert command(args).returncode == 0  # on a CPU: eager by default
    (tmp_path / FILE_NAME).write_bytes(b"\x00garbage")
    checkpoint = (tmp_path / "last.pt").read_bytes()
    resumed = command([*args, "--epochs", "2", "--compile"])
    assert resumed.returncode == 0, resumed.stderr
    said = [line for line in resumed.stderr.splitlines() if "compile" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), resumed.stderr  # one warning: the file, what it is not
    assert_names(said[0], tmp_path / FILE_NAME, "not a compile cache")
    line, cost = restart_cost(resumed.stdout)  # the first step: compiling (cold) and the step itself
    assert {"compile", "the step itself"} <= cost.keys(), line
    assert_names(line, "compile", "cold cache", "the step itself")
    assert (tmp_path / "epoch_0001.pt").read_bytes() == checkpoint and load_checkpoint(tmp_path / "last.pt")["step"]


def test_without_compile_nothing_compiles_and_no_cache_is_read_or_written(image_folder, tmp_path, monkeypatch,
                                                                           mega_cache):
    monkeypatch.setattr(compiling, "CompiledOrEager", pytest.fail)
    monkeypatch.setattr(compile_cache.CompileCache, "load", pytest.fail)
    mega_cache.artifacts = {"inductor": ["graph"]}
    args = [str(image_folder), *RUN, "--checkpoints-path", str(tmp_path), "--resume"]
    default = command(args)
    assert default.returncode == 0, default.stderr
    assert table_row(default.stdout) == "True / off: CPU default"
    refused = command([*args, "--epochs", "2", "--no-compile"])
    assert refused.returncode == 0, refused.stderr
    assert table_row(refused.stdout) == "True / off: --no-compile"
    assert "compile" not in re.search(r"first step .*", refused.stdout).group(0)
    assert not (tmp_path / FILE_NAME).exists()


# ----------------------------------------------------------------------------- inductor, for real


def run_args(image_folder: Path, checkpoints: Path) -> list[str]:
    return [str(image_folder), *SMALL_RUN, "--workers", "0", "--max-steps-per-epoch", "2", "--no-tensorboard",
            "--checkpoints-path", str(checkpoints), "--resume"]


@pytest.fixture(scope="module")
def compiled_epoch(image_folder, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One epoch of a compiled run (inductor, for real, on tests/compiled_small.py's model: test_resnet's compile took
    ~40 s on 2 cores) in a process whose local compile caches start empty: its checkpoints folder, which each test
    copies before it resumes, and its output."""
    work = tmp_path_factory.mktemp("compiled")
    first = compiled_run([*run_args(image_folder, work / "ckpt"), "--epochs", "1", "--compile"], work / "caches")
    return work / "ckpt", first


def resumable_copy(compiled_epoch: tuple[Path, subprocess.CompletedProcess], tmp_path: Path) -> Path:
    shutil.copytree(compiled_epoch[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.slow
def test_compiled_run_checkpoints_eager_keys_and_an_eager_run_resumes_it(image_folder, compiled_epoch, tmp_path):
    """torch.compile wraps the model, but checkpoints hold the original module's state, so a run without --compile
    continues from them, and the reverse. The compiled run keeps torch's caches (the real Mega-Cache) beside its
    checkpoints, under its key."""
    ckpt = resumable_copy(compiled_epoch, tmp_path)
    assert "True / on: --compile; compile cache none yet" in compiled_epoch[1].stdout  # channels_last / compile
    if compile_cache.supported():
        header, _ = decode((ckpt / FILE_NAME).read_bytes())
        assert header["key"]["model"] == "test_resnet" and any(a.startswith("inductor:") for a in header["artifacts"])
    snapshot = load_checkpoint(ckpt / "last.pt")
    assert list(snapshot["model"]) == list(small_model("test_resnet", 4).state_dict())
    assert np.isfinite(snapshot["history"][0]["train_loss"])
    eager = compiled_run([*run_args(image_folder, ckpt), "--epochs", "2"], tmp_path / "caches")  # no --compile
    assert "resuming from" in eager.stdout
    warnings = [line for line in eager.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].endswith("epochs: checkpoint 1, now 2")  # not the compile flag
    assert [row["epoch"] for row in load_checkpoint(ckpt / "last.pt")["history"]] == [1, 2]


@pytest.mark.slow
@pytest.mark.skipif(not compile_cache.supported(), reason="this torch has no Mega-Cache")
def test_a_restart_with_empty_local_caches_compiles_from_the_checkpoints_cache_file(image_folder, compiled_epoch,
                                                                                    tmp_path):
    """Inductor on the CPU, two processes one after another: the first (compiled_epoch) compiles with empty local
    caches and writes CHECKPOINTS/compile_cache.bin; the second resumes with new, empty local caches, and every graph
    Inductor would compile comes from that file (its own count of FX graph cache hits, in the restart line). A file
    whose blob torch cannot read back:
    test_a_blob_torch_cannot_read_back_is_not_loaded_and_is_one_warning_without_torchs_traceback
    (torch's own reader, in this process) and test_a_damaged_cache_file_costs_a_warning_not_the_run_nor_its_checkpoints
    (a run that meets one and rewrites it)."""
    checkpoints = resumable_copy(compiled_epoch, tmp_path)
    path = checkpoints / FILE_NAME
    header, _ = decode(path.read_bytes())
    assert any(a.startswith("inductor:") for a in header["artifacts"])

    resumed = compiled_run([*run_args(image_folder, checkpoints), "--epochs", "2", "--compile"], tmp_path / "second")
    restart = re.search(r"first step [\d.]+ s \(compile [\d.]+ s, (.*); the step itself", resumed.stdout).group(1)
    served = re.fullmatch(rf"cache loaded from {re.escape(str(path))}: (\d+) of (\d+) Inductor graphs from the caches",
                          restart)
    assert served and int(served.group(1)) == int(served.group(2)) >= 2, restart  # forward and backward, at least
    assert "compile" not in resumed.stderr



@pytest.mark.parametrize("variable", compile_cache.CACHE_VARIABLES)
def test_a_compile_cache_variable_naming_a_file_is_one_line_before_the_data_is_read(variable, tmp_path, monkeypatch):
    """torch makes TORCHINDUCTOR_CACHE_DIR at its compiler's import (timm's): a file there was a FileExistsError
    traceback. It is refused first, naming the variable and the file, also for a path through the file."""
    taken = tmp_path / "cache"
    taken.write_text("mine")
    for value in (taken, taken / "sub"):
        monkeypatch.setenv(variable, str(value))
        finished = command([str(tmp_path / "no-data"), *RUN, "--checkpoints-path", str(tmp_path / "ckpt")])
        assert finished.returncode == 2
        assert_names(single_line(finished.stderr), f"{variable}={value}", taken)
    assert taken.read_text() == "mine" and not (tmp_path / "ckpt").exists()


def test_a_compile_cache_variable_through_a_dangling_link_is_refused(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # torch's makedirs would meet FileExistsError there
    with pytest.raises(UserError) as raised:
        compile_cache.check_cache_folders({"TRITON_CACHE_DIR": str(tmp_path / "link" / "triton")})
    assert_names(str(raised.value), "TRITON_CACHE_DIR", tmp_path / "link")


def test_compile_cache_variables_naming_folders_or_new_paths_pass(tmp_path):
    compile_cache.check_cache_folders({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
                                       "TRITON_CACHE_DIR": str(tmp_path / "a" / "b")})
    compile_cache.check_cache_folders({})


def test_a_compile_cache_variable_naming_a_file_exits_2_without_a_traceback(tmp_path):
    """In a process of its own, where torch's compiler is not imported yet: the real import would raise."""
    (tmp_path / "cache").write_text("")
    env = child_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-m", "imagenet_elastic", str(tmp_path), *RUN], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert_names(single_line(result.stderr), "TORCHINDUCTOR_CACHE_DIR", tmp_path / "cache")

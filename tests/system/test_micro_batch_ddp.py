"""--micro-batch auto under DDP, two gloo processes: an out-of-memory error on one rank only, before DDP's forward,
inside a micro-batch's forward, in the middle of the synchronising backward (gradient buckets already all-reduced),
or in --decode gpu's decode of the step's batch (told before the step), deadlocks no rank; every rank redoes the step
with half the micro-batch and ends with the bits of a run that used the smaller micro-batch from that step on, a
second error ends every rank with one line, and ranks resuming from other choices take the smallest (the step's own
pieces, spawned; then the whole program under torchrun, with the error injected by tests/oom_injected.py)."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import fault_injection as fi
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import (
    REPO,
    SHORT_RUN,
    assert_names,
    assert_same_tensors,
    finish,
    load_checkpoint,
    several_at_once,
    single_line,
    start,
    torchrun_cmd,
)
from ddp_failures import FAILING_STEP, Failure, context, model

from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.train import micro_batch
from imagenet_elastic.train.micro_batch import MicroBatches, OutOfMemoryAgain
from imagenet_elastic.train.step import StepContext

STEPS, GLOBAL, LOADER_MICRO = 4, 16, 4  # two micro-batches of 4 per rank, then four of 2 (from FAILING_STEP)


def global_batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(100 + step)
    return Batch(torch.randint(0, 256, (GLOBAL, 6, 6, 3), dtype=torch.uint8, generator=g),
                 torch.randint(0, 5, (GLOBAL,), generator=g), torch.arange(GLOBAL))


def train(micro: MicroBatches, ctx: StepContext, rank: int, steps: int = STEPS, before=None) -> None:
    loader = BatchPlan(GLOBAL, 2, LOADER_MICRO)
    for step in range(steps):
        if before is not None:
            before(step, micro)
        data = global_batch(step)
        micro.step(ctx, [data.part(part) for part in loader.micro_slices(rank)], 0.1, 0, step)


WHERE = ("before DDP's forward", "in the second micro-batch's forward", "in the synchronising backward",
         "decoding the step's batch")


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        # the reference: micro-batches of 4 until FAILING_STEP, of 2 from there on
        net = model()
        ctx = context(net)
        loader = BatchPlan(GLOBAL, 2, LOADER_MICRO)
        fixed = {4: MicroBatches(loader, 4, rank), 2: MicroBatches(loader, 2, rank)}
        for step in range(STEPS):
            data = global_batch(step)
            fixed[4 if step < FAILING_STEP else 2].step(ctx, [data.part(p) for p in loader.micro_slices(rank)], 0.1, 0,
                                                         step)
        results["reference"] = {k: v.clone() for k, v in net.state_dict().items()}
        for where in WHERE:
            net = model()
            ctx = context(net)
            micro = MicroBatches(loader, 4, rank, auto=True, warn=lambda line: results.setdefault("said", []).append(
                line))
            failure = Failure(where, ctx, rank)
            train(micro, ctx, rank, before=failure.before)
            results[where] = ({k: v.clone() for k, v in net.state_dict().items()}, micro.size, failure.armed,
                              failure.launched, len(ctx.model.reducer._get_zeros_like_grad_buckets()))
        net = model()  # a run that halved once already: the next error ends every rank
        ctx = context(net)
        micro = MicroBatches(loader, 4, rank, auto=True)
        micro.halved["training"] = True
        failure = Failure(WHERE[1], ctx, rank)
        try:
            train(micro, ctx, rank, before=failure.before)
        except OutOfMemoryAgain as error:
            results["again"] = str(error)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_out_of_memory_error_on_one_rank_is_redone_by_every_rank_with_half_the_micro_batch(tmp_path):
    mp.start_processes(worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, results in enumerate(ranks):
        for where in WHERE:
            state, size, armed, launched, buckets = results[where]
            assert armed == (rank == 0), f"{where}: rank 1 alone runs out of memory, once"
            assert size == 2, where
            for key, value in results["reference"].items():
                assert torch.equal(state[key], value), f"{where}: rank {rank}'s {key} differs from the reference"
    launched, buckets = ranks[1][WHERE[2]][3:]
    assert 0 < launched < buckets, f"the backward failed after {launched} of {buckets} buckets' all-reduces"
    assert "said" not in ranks[0] and len(ranks[1]["said"]) == len(WHERE)
    assert "redone with micro-batches of 2, on every rank" in ranks[1]["said"][0]
    # decoding: the batch's size, the step, torch's error, and the smaller micro-batch every rank redoes it with
    assert_names(single_line(ranks[1]["said"][3]), "decoding", "4 images", "step 3", "(CUDA out of memory (injected, "
                 "decoding))", "micro-batches of 2", "every rank")
    again = "out of memory again in training step 3 with micro-batches of 4 (halved once already in this run)"
    assert ranks[1]["again"] == f"{again}: CUDA out of memory (injected); lower --batch-size"
    assert ranks[0]["again"] == f"{again}, on another rank"


def choice_worker(rank: int, port: int, out: str) -> None:
    """--micro-batch auto's choice at start on a rank whose checkpoint says 8 (rank 0) or 4 (rank 1): ranks on
    different GPUs, each resuming from its own choice."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        settings = {"model": "test_resnet", "image_size": 32}
        saved = {"size": (8, 4)[rank], "device": "cpu", "memory": 0, "settings": settings}

        def probe(first, smaller):
            raise AssertionError("no probe: the checkpoint's choice holds")
        micro = micro_batch.choose(True, BatchPlan(16, 2, 8), rank, False, torch.device("cpu"), settings, saved, probe,
                                   print)
        torch.save({"size": micro.size, "saved": micro.saved()["micro_batch"]["size"], "said": micro.describe()},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_with_other_choices_all_take_the_smallest_and_the_larger_one_says_so(tmp_path):
    mp.start_processes(choice_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [(r["size"], r["saved"]) for r in ranks] == [(4, 4), (4, 4)]
    said = [r["said"].split(";")[0] for r in ranks]
    for line in said:  # auto's choice: 4 images a forward pass, from the checkpoint, for this device
        assert_names(single_line(line), "auto", "4 images", "checkpoint", "(cpu)")
    assert_names(said[0], "(cpu)", "4", "another rank")  # rank 0's checkpoint said 8: it names where 4 comes from
    assert "another rank" not in said[1], said


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.usefixtures("warm_ranks")  # the ranks torchrun starts: forks of the warm python
def test_two_ranks_under_torchrun_redo_the_step_one_of_them_could_not_fit(image_folder, tmp_path):
    """The whole program: rank 1 runs out of memory with micro-batches of 8 from its first step (rank 0 does not);
    both go on with micro-batches of 4, and end with the bits of a run set to 4 from the start."""
    several_at_once()
    args = [str(image_folder), *SHORT_RUN, "--workers", "0"]
    reference = start(torchrun_cmd(2, *args, "--batch-size", "4", "--global-batch-size", "16", "--checkpoints-path",
                                   str(tmp_path / "reference")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "oom_injected.py"), *args, "--micro-batch", "auto", "--checkpoints-path",
           str(tmp_path / "auto")]
    result = subprocess.run(cmd, cwd=REPO, env=fi.clean_env(OOM_RANK="1", OOM_LIMIT="4"), capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert finish(reference).returncode == 0
    said = [line for line in result.stderr.splitlines() if "out of memory" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), result.stderr  # once, by the rank that ran out
    assert_names(said[0], "rank 1", "step 1", "micro-batches of 8", "micro-batches of 4", "every rank")
    auto, expected = (load_checkpoint(tmp_path / name / "last.pt") for name in ("auto", "reference"))
    assert auto["micro_batch"]["size"] == 4
    assert_same_tensors(auto["model"], expected["model"])
    assert_same_tensors(auto["optimizer"], expected["optimizer"])

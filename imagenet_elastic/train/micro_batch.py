"""The micro-batches a training step computes in, and with --micro-batch auto the largest that fits the GPU: found
before the first step (memory_probe.py), kept in the checkpoints for that kind of GPU, halved when a step or a
validation pass still runs out of memory.

The loader keeps cutting each rank's share into --batch-size's micro-batches (its workers, pinned buffers and
prefetch are sized for them); a step regroups them (`regroup`) into the micro-batches of the plan it computes in,
at the positions in the global batch a run started with that micro-batch has. BatchNorm (the first micro-batch of
each share updates the running statistics), dropout and drop path (drawn from the step and the position) and mixing
(pairs at even positions) therefore see what that run sees, and the weights follow it (bit for bit on a CPU).

A step that runs out of memory under --micro-batch auto is redone at once with micro-batches of half the size, for
the rest of the run: its gradients are dropped and the buffers its forward passes updated (BatchNorm's statistics,
copied before every step) put back; dropout and drop path draw again from (seed, step, position), so the redone
step is the step of a run with the smaller micro-batch. Under DDP the out-of-memory error may hit one rank only:
that rank makes the rest of the step's collectives (ddp_ledger.py), and every rank learns whether any failed from
one all-reduce of a flag per step, on the CPU control group (no wait for the GPU), before the optimizer steps.
Each kind of pass (training, validation) halves once per run: a second out-of-memory error of that kind ends the
run, as one that keeps running out of memory has a cause that smaller micro-batches would only hide. A validation
pass has no collective before its end: each rank halves its own validation batches. An out-of-memory error in the
optimizer's step is not caught: the weights have changed by then, and smaller micro-batches would not help (the
probe runs that step too).

Under --decode gpu the decoding thread (data/device/feed.py) allocates beside the step it runs ahead of, and can run
out of memory where the step alone fits. That error reaches the training thread with the batch, before the step that
takes it: under --micro-batch auto it counts as that step's (`decode_failed`: the step halves its micro-batches, on
every rank, and the batch is decoded again, nothing lost or repeated); without it the run ends in one line saying what
to change.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.errors import UserError, one_line
from imagenet_elastic.launch import distributed
from imagenet_elastic.train import memory_probe
from imagenet_elastic.train.ddp_ledger import CollectiveLedger
from imagenet_elastic.train.mixing import whole_pairs
from imagenet_elastic.train.step import BufferCopy, StepContext, accumulate, apply_gradients, train_step

AUTO = "auto"


class OutOfMemoryAgain(UserError):
    """A second out-of-memory error of one kind of pass in a run (see the module's docstring)."""

    every_rank = True


class DecodeOutOfMemory(UserError):
    """--decode gpu ran out of device memory decoding a batch, and nothing (no --micro-batch auto) makes room."""

    every_rank = True


def regroup(batches: list[Batch], given: list[slice], wanted: list[slice]) -> list[Batch]:
    """This rank's micro-batches of a step, given at the positions `given`, as the micro-batches at `wanted` (the
    same positions, cut otherwise): views of the given ones, joined where a wanted one spans two."""
    if given == wanted:
        return batches
    out = []
    for part in wanted:
        pieces = [batch.part(slice(max(part.start, cut.start) - cut.start, min(part.stop, cut.stop) - cut.start))
                  for batch, cut in zip(batches, given) if cut.start < part.stop and part.start < cut.stop]
        out.append(pieces[0] if len(pieces) == 1 else Batch(
            torch.cat([p.images for p in pieces]), torch.cat([p.labels for p in pieces]),
            None if pieces[0].indices is None else torch.cat([p.indices for p in pieces])))
    return out


def fitting_plan(global_batch: int, world_size: int, size: int, mixes: bool) -> Optional[BatchPlan]:
    """The plan of micro-batches of at most `size`, the largest such size that keeps mixing's pairs whole (under
    --mixup-alpha/--cutmix-alpha) on every rank; None when none does."""
    for candidate in range(size, 0, -1):
        plan = BatchPlan(global_batch, world_size, candidate)
        if not mixes or all(whole_pairs(part) for part in plan.all_micro_slices()):
            return plan
    return None


@dataclasses.dataclass(frozen=True)
class Choice:
    """--micro-batch auto's answer, and what it holds for: the checkpoint keeps it (`saved`) for a restart."""

    size: int
    device: str  # the GPU's name; "cpu" on a CPU
    memory: int  # its total memory in bytes; 0 on a CPU
    settings: dict  # the other settings that decide a step's memory (memory_settings)
    how: str  # for the start-up table: probed, or the checkpoint's

    def saved(self) -> dict[str, Any]:
        return {"size": self.size, "device": self.device, "memory": self.memory, "settings": self.settings}

    def holds_for(self, saved: Optional[dict[str, Any]]) -> bool:
        """Whether a checkpoint's choice was made on this kind of GPU, with these settings."""
        return bool(saved) and all(saved.get(k) == v for k, v in self.saved().items() if k != "size")


class MicroBatches:
    """How a step cuts the loader's micro-batches (`loader`, --batch-size's plan) into the ones it computes in
    (`plan`), and validation its batches; with `auto`, each halves once on an out-of-memory error."""

    def __init__(self, loader: BatchPlan, size: int, rank: int, auto: bool = False, mixes: bool = False,
                 choice: Optional[Choice] = None, warn: Callable[[str], None] = print) -> None:
        self.loader, self.rank, self.auto, self.mixes, self.choice, self.warn = loader, rank, auto, mixes, choice, warn
        self.given = loader.micro_slices(rank)  # where the loader's micro-batches sit in the global batch
        self.use(loader if size == loader.micro_batch else fitting_plan(loader.global_batch, loader.world_size, size,
                                                                        mixes))
        self.validation_batch: Optional[int] = loader.micro_batch if auto else None  # None: the loader's, whole
        self.halved = {"training": False, "validation": False}
        self.buffers: Optional[BufferCopy] = None  # auto: made at the first step (`prepare`)
        self.decoding: Optional[tuple[str, str]] = None  # a training batch's decode ran out of memory: (what, line)
        self.ledger: Optional[CollectiveLedger] = None

    def use(self, plan: BatchPlan) -> None:
        self.plan, self.slices = plan, plan.micro_slices(self.rank)

    @property
    def size(self) -> int:
        return self.plan.micro_batch

    def step(self, ctx: StepContext, batches: list[Batch], lr: float, seed: int, step: int) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches from the loader; returns the rank's mean loss (on
        device)."""
        if not self.auto:
            return train_step(ctx, regroup(batches, self.given, self.slices), self.slices, self.plan.share, lr, seed,
                              step)
        self.prepare(ctx)
        while True:
            loss, error = self.attempt(ctx, regroup(batches, self.given, self.slices), seed, step)
            failed, decoding = distributed.agree([error is not None, self.decoding is not None])  # under DDP: on
            if not (failed or decoding):  # the CPU control group
                break
            what = f"in training step {step + 1} with micro-batches of {self.size}"
            if error is None and self.decoding is not None:
                what, error = self.decoding
            self.decoding = None
            self.halve("training", what, error, self.size)
            self.buffers.restore()
            if self.ledger is not None:
                self.ledger.reset()
        apply_gradients(ctx, lr)
        return loss

    def prepare(self, ctx: StepContext) -> None:
        """Before the first step: the copy of the buffers, and under DDP the ledger (ddp_ledger.py), whose hooks go
        in before DDP's first forward."""
        if self.buffers is None:
            self.buffers = BufferCopy(ctx.model.buffers())
            if isinstance(ctx.model, DistributedDataParallel):
                self.ledger = CollectiveLedger(ctx.model)

    def attempt(self, ctx: StepContext, micro_batches: list[Batch], seed: int, step: int
                ) -> tuple[Optional[torch.Tensor], Optional[str]]:
        """The step's forward and backward passes: their loss, or the out-of-memory error's line. After a failure the
        partial gradients are gone and, under DDP, the rest of the step's collectives made (ddp_ledger.py)."""
        self.buffers.keep()
        if self.ledger is not None:
            self.ledger.start()
        try:
            return accumulate(ctx, micro_batches, self.slices, self.plan.share, seed, step), None
        except torch.OutOfMemoryError as error:
            failed = one_line(error)  # the attempt's tensors go with the traceback, when this handler ends
        ctx.optimizer.zero_grad(set_to_none=True)
        if self.ledger is not None:
            self.ledger.settle()
        memory_probe.release_cached_memory(ctx.input.device)
        return None, failed

    def decode_failed(self, kind: str, what: str, error: str, again: bool) -> None:
        """--decode gpu ran out of device memory `what` (decoding a batch for `kind`: training or validation; `again`:
        that batch did before); the batch is decoded again when this returns. Without --micro-batch auto the run ends
        in one line. With it, the micro-batches halve to leave the decoding room, as after a step's out-of-memory
        error: training's at the step that takes the batch (which every rank agrees on, then redoes in halves),
        validation's at once. A batch that fails again, decoded with no step beside it, ends the run."""
        if not self.auto:
            raise DecodeOutOfMemory(f"out of device memory {what} (--decode gpu: {error}); lower --batch-size, or add "
                                    "--micro-batch auto to train in smaller micro-batches beside the decoding, or "
                                    "decode in the loader workers (--decode cpu)")
        if again:
            raise OutOfMemoryAgain(f"out of memory again {what}, with no step beside it ({error}); lower --batch-size, "
                                   "or decode in the loader workers (--decode cpu)")
        if kind == "validation":
            self.halve("validation", what, error, self.validation_batch or 1)
        elif self.decoding is None:  # another batch before that step: decoded again, the one halving to come
            self.decoding = (what, error)

    def validation_failed(self, size: int, error: str) -> None:
        """Validation ran out of memory on a batch of `size`: its batches are halved for the rest of the run."""
        self.halve("validation", f"validating a batch of {size}", error, size)

    def halve(self, kind: str, what: str, error: Optional[str], size: int) -> None:
        """Halve `kind`'s micro-batches (now of `size`), once in a run; `error`: this rank's out-of-memory line
        (None: another rank's). Raises OutOfMemoryAgain when they were halved before or cannot be."""
        smaller = next_smaller(self.loader, size, self.mixes) if kind == "training" else size // 2 or None
        if self.halved[kind] or smaller is None:
            line = f"out of memory again {what} (" + ("halved once already in this run" if self.halved[kind]
                                                       else "nothing smaller to try") + ")"
            raise OutOfMemoryAgain(f"{line}: {error}; lower --batch-size" if error else f"{line}, on another rank")
        self.halved[kind] = True
        if kind == "training":
            self.use(fitting_plan(self.loader.global_batch, self.loader.world_size, smaller, self.mixes))
            then = f"redone with micro-batches of {smaller}" + (", on every rank" if self.loader.world_size > 1
                                                                else "") + ", for the rest of the run"
        else:
            self.validation_batch = smaller
            then = f"validating in batches of {smaller} for the rest of the run"
        if error is not None:
            self.warn(f"out of memory {what} ({error}): {then}")

    def saved(self) -> dict[str, Any]:
        """What the checkpoint keeps: the micro-batch in use (halved or not) and what it was chosen for."""
        if self.choice is None:
            return {}
        return {"micro_batch": dict(self.choice.saved(), size=self.size)}

    def describe(self) -> str:
        if not self.auto:
            return f"at most {self.size} images a forward pass (--batch-size)"
        text = f"auto: at most {self.size} images a forward pass" + (f", {self.choice.how}" if self.choice else "")
        if self.slices != self.given:
            text += f"; the loader's micro-batches of {self.loader.micro_batch} regrouped"
        return text + "; a step or validation that runs out of memory is redone in halves (once per run each)"


# ------------------------------------------------------------------ the choice at start


def choose(auto: bool, loader: BatchPlan, rank: int, mixes: bool, device: torch.device,
           settings: dict[str, Any], saved: Optional[dict[str, Any]], probe: Callable[[int, Callable], int],
           warn: Callable[[str], None]) -> MicroBatches:
    """The run's micro-batches. Without `auto`: --batch-size's. With it: a checkpoint's choice (`saved`) made on this
    kind of GPU with these settings; else on CUDA `probe(first, smaller)`'s answer (the smallest over ranks);
    else (a CPU) --batch-size's."""
    if not auto:
        return MicroBatches(loader, loader.micro_batch, rank)
    name, memory = device_identity(device)
    first = max(s.stop - s.start for s in loader.all_micro_slices())  # no forward pass takes more
    if saved and Choice(0, name, memory, settings, "").holds_for(saved):
        size, how = min(int(saved["size"]), first), f"the checkpoint's for this GPU ({describe_gpu(name, memory)})"
    elif probes(device):
        start = time.perf_counter()
        size = probe(first, lambda s: next_smaller(loader, s, mixes))
        how = (f"the largest that fits {describe_gpu(name, memory)} (probed in {time.perf_counter() - start:.1f} s "
               f"from {first}, eager)")
    else:
        size, how = first, "--batch-size's" + (" (nothing to probe on a CPU)" if device.type != "cuda" else "")
    agreed = smallest_over_ranks(size)
    if agreed < size:
        how += f", {agreed} on another rank"
    plan = fitting_plan(loader.global_batch, loader.world_size, agreed, mixes)
    return MicroBatches(loader, plan.micro_batch, rank, auto=True, mixes=mixes,
                        choice=Choice(plan.micro_batch, name, memory, settings, how), warn=warn)


def next_smaller(loader: BatchPlan, size: int, mixes: bool) -> Optional[int]:
    plan = fitting_plan(loader.global_batch, loader.world_size, size // 2, mixes) if size > 1 else None
    return plan.micro_batch if plan is not None else None


def probes(device: torch.device) -> bool:
    """Where the probe runs: on CUDA, whose allocator raises an out-of-memory error (a CPU's swaps, or is killed)."""
    return device.type == "cuda"


def device_identity(device: torch.device) -> tuple[str, int]:
    """The kind of GPU: its name and total memory (bytes); ("cpu", 0) on a CPU."""
    if device.type != "cuda":
        return "cpu", 0
    properties = torch.cuda.get_device_properties(device)
    return properties.name, int(properties.total_memory)


def describe_gpu(name: str, memory: int) -> str:
    return f"{name}, {memory / 2**30:.1f} GiB" if memory else name


def smallest_over_ranks(size: int) -> int:
    """The smallest of the ranks' sizes (ranks may sit on different GPUs), through the CPU control group."""
    if not distributed.is_initialized():
        return size
    return -int(distributed.all_reduce_max(torch.tensor([-size], dtype=torch.int64))[0])

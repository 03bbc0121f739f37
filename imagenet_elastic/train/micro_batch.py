"""The micro-batches a training step computes in; with --micro-batch auto the largest that fits the GPU
(docs/LAUNCHING.md, "An out-of-memory error"): probed (memory_probe.py), kept in checkpoints for that kind of GPU,
halved once per run for each kind of pass that still runs out of memory (validation per rank; a step on every rank,
agreed by one flag all-reduce on the CPU group before the optimizer steps, the failed rank making the step's other
collectives: ddp_ledger.py). `regroup` recuts the loader's micro-batches where a run started at the smaller size has
them, so BatchNorm (only a share's first micro-batch updates the running statistics), dropout, drop path (drawn from
step and position) and mixing see what that run sees (bit for bit on a CPU). An error in the optimizer's step is not
caught: the weights have changed, and the probe ran that step too."""

from __future__ import annotations

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
    """Out of device memory with no more room to make: a second time for one kind of pass in a run (see the module's
    docstring), or --decode gpu's first time without --micro-batch auto."""

    every_rank = True


def regroup(batches: list[Batch], given: list[slice], wanted: list[slice]) -> list[Batch]:
    """This rank's micro-batches at the positions `given`, recut at `wanted`: views, joined where one spans two."""
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
    """The plan of the largest micro-batches of at most `size` keeping mixing's pairs whole on every rank, or None."""
    plans = (BatchPlan(global_batch, world_size, candidate) for candidate in range(size, 0, -1))
    return next((plan for plan in plans if not mixes or all(map(whole_pairs, plan.all_micro_slices()))), None)


class MicroBatches:
    """Recuts the loader's micro-batches into `plan`'s and sizes validation's; with `auto` each halves once on OOM.
    `chosen_for`: what auto's size holds for (`choose`), kept in checkpoints beside the size in use; `how`: how it was
    found, for the start-up table."""

    def __init__(self, loader: BatchPlan, size: int, rank: int, auto: bool = False, mixes: bool = False,
                 chosen_for: Optional[dict[str, Any]] = None, how: str = "", warn: Callable[[str], None] = print
                 ) -> None:
        self.loader, self.rank, self.auto, self.mixes, self.warn = loader, rank, auto, mixes, warn
        self.chosen_for, self.how = chosen_for, how
        self.given = loader.micro_slices(rank)  # where the loader's micro-batches sit in the global batch
        self.use(fitting_plan(loader.global_batch, loader.world_size, size, mixes))
        self.validation_batch: Optional[int] = loader.micro_batch if auto else None  # None: the loader's, whole
        self.halved = {"training": False, "validation": False}
        self.buffers: Optional[BufferCopy] = None  # auto: made at the first step
        self.decoding: Optional[tuple[str, str]] = None  # a training batch's decode ran out of memory: (what, line)
        self.ledger: Optional[CollectiveLedger] = None

    def use(self, plan: BatchPlan) -> None:
        self.plan, self.slices = plan, plan.micro_slices(self.rank)

    @property
    def size(self) -> int:
        return self.plan.micro_batch

    def step(self, ctx: StepContext, batches: list[Batch], lr: float, seed: int, step: int) -> torch.Tensor:
        """One optimizer step over the loader's micro-batches of this rank; returns its mean loss (on device)."""
        if not self.auto:
            return train_step(ctx, regroup(batches, self.given, self.slices), self.slices, self.plan.share, lr, seed,
                              step)
        if self.buffers is None:  # the first step: the DDP ledger's hooks must precede DDP's first forward
            self.buffers = BufferCopy(ctx.model.buffers())
            if isinstance(ctx.model, DistributedDataParallel):
                self.ledger = CollectiveLedger(ctx.model)
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
        """--decode gpu ran out of memory `what` (decoding for `kind`; `again`: that batch did before), to be
        decoded again: the decoding thread allocates beside the step it runs ahead of, so it can fail where the step
        alone fits. Without `auto` the run ends; with it micro-batches halve to make room: training's at the step
        taking the batch (every rank; nothing lost), validation's at once; a second failure ends it."""
        if not self.auto:
            raise OutOfMemoryAgain(f"out of device memory {what} (--decode gpu: {error}); lower --batch-size, or add "
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
        return {} if self.chosen_for is None else {"micro_batch": {"size": self.size, **self.chosen_for}}

    def describe(self) -> str:
        if not self.auto:
            return f"at most {self.size} images a forward pass (--batch-size)"
        text = f"auto: at most {self.size} images a forward pass" + (f", {self.how}" if self.how else "")
        if self.slices != self.given:
            text += f"; the loader's micro-batches of {self.loader.micro_batch} regrouped"
        return text + "; a step or validation that runs out of memory is redone in halves (once per run each)"


def choose(auto: bool, loader: BatchPlan, rank: int, mixes: bool, device: torch.device,
           settings: dict[str, Any], saved: Optional[dict[str, Any]], probe: Callable[[int, Callable], int],
           warn: Callable[[str], None]) -> MicroBatches:
    """The run's micro-batches: --batch-size's without `auto`; with it a checkpoint's choice for this GPU and these
    settings, else on CUDA `probe`'s (the smallest over ranks), else --batch-size's."""
    if not auto:
        return MicroBatches(loader, loader.micro_batch, rank)
    name, memory = device_identity(device)
    # what the choice holds for: this kind of GPU, and the settings that decide a step's memory (fit_micro_batches)
    held = {"device": name, "memory": memory, "settings": settings}
    first = max(s.stop - s.start for s in loader.all_micro_slices())  # no forward pass takes more
    if saved and all(saved.get(k) == v for k, v in held.items()):
        size, how = min(int(saved["size"]), first), f"the checkpoint's for this GPU ({describe_gpu(name, memory)})"
    elif probes(device):
        start = time.perf_counter()
        size = probe(first, lambda s: next_smaller(loader, s, mixes))
        how = (f"the largest that fits {describe_gpu(name, memory)} (probed in {time.perf_counter() - start:.1f} s "
               f"from {first}, eager)")
    else:
        size, how = first, "--batch-size's (nothing to probe on a CPU)"  # the device is a CPU or CUDA
    # the smallest over ranks (they may sit on different GPUs), through the CPU control group
    agreed = -int(distributed.all_reduce_max(torch.tensor([-size], dtype=torch.int64))[0])
    if agreed < size:
        how += f", {agreed} on another rank"
    return MicroBatches(loader, agreed, rank, auto=True, mixes=mixes, chosen_for=held, how=how, warn=warn)


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


"""The run from start to finish: inputs checked, state restored, epochs trained, checkpoints committed."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from imagenet_elastic import checkpoint, data, distributed, file_index, gpu_decode, metrics, preemption
from imagenet_elastic.checkpoint import CheckpointLock, CheckpointManager
from imagenet_elastic.checkpoint_writer import CheckpointWriter
from imagenet_elastic.config import Config
from imagenet_elastic.console import Console
from imagenet_elastic.distributed import DistEnv
from imagenet_elastic.engine import EvalResult, StepContext, device_batches, evaluate, step_groups, train_step
from imagenet_elastic.errors import PREEMPTED_EXIT, Preempted, StorageError, UserError, one_line
from imagenet_elastic.model import (
    count_parameters,
    create_model,
    create_optimizer,
    place_model,
    resolve_precision,
)
from imagenet_elastic.preemption import PreemptionFlag
from imagenet_elastic.samplelog import ENV_VAR as SAMPLE_LOG_VAR
from imagenet_elastic.samplelog import SampleLog
from imagenet_elastic.sampler import BatchPlan, TrainBatchSampler, resolve_global_batch
from imagenet_elastic.schedule import lr_at, scaled_lr
from imagenet_elastic.state import EpochTally, PendingSteps, TrainState, check_compatible


def describe_index(index: file_index.ImageIndex) -> str:
    return f"{len(index)} in {index.root}" + (" (file list from the cache)" if index.cached else "")


LOCK_WAIT_S = 60.0  # how long rank 0 waits for a checkpoints folder held by another (dying) run


class Trainer:
    def __init__(self, config: Config, env: DistEnv, console: Console, preempt: PreemptionFlag) -> None:
        self.config, self.env, self.console, self.preempt = config, env, console, preempt
        self.threads = distributed.configure_threads(config.threads, env.local_world_size)
        self.device = distributed.select_device(config.device, env)

        # Every check that can fail on user input runs before the process group exists.
        train_dir, val_dir = file_index.resolve_split_dirs(config.data, config.val_path)
        self.train_index = file_index.load_index(train_dir, "train", config.checkpoints_path)
        self.val_index = file_index.load_index(val_dir, "val", config.checkpoints_path)
        file_index.check_same_classes(self.train_index, self.val_index)
        if config.requeue_on_preempt and preemption.slurm_job_to_requeue(os.environ) is None:
            raise UserError("--requeue-on-preempt needs a Slurm job, but SLURM_JOB_ID is not set")
        self.checkpoints = CheckpointManager(config.checkpoints_path, config.keep_checkpoints, console.warn)
        self.lock = CheckpointLock(config.checkpoints_path)
        if not config.evaluate:
            checkpoint.check_writable(config.checkpoints_path)
            if env.is_main:
                wait = min(LOCK_WAIT_S, config.dist_timeout)
                self.lock.acquire(wait, lambda holder: console.warn(
                    f"{config.checkpoints_path} is locked by {holder}; waiting up to {wait:g} s"))
        self.resume_from = self.checkpoints.resume_path(config.resume, restarted=env.restart_count > 0)
        if config.evaluate and self.resume_from is None:
            raise UserError("--evaluate needs a checkpoint: pass --resume PATH")
        load_start = time.perf_counter()
        snapshot = checkpoint.load(self.resume_from) if self.resume_from else None
        self.load_seconds = time.perf_counter() - load_start
        if snapshot is not None:
            check_compatible(snapshot, self.resume_from, config.model, self.train_index.classes)

        saved_batch = snapshot.get("global_batch") if snapshot and not config.evaluate else None
        self.plan = BatchPlan(resolve_global_batch(config.global_batch_size, saved_batch, config.batch_size,
                                                   env.world_size), env.world_size, config.batch_size)
        self.sampler = TrainBatchSampler(len(self.train_index), self.plan, env.rank, config.seed,
                                         config.max_steps_per_epoch)

        torch.manual_seed(config.seed)
        self.precision = resolve_precision(config.amp, self.device)
        if self.precision.warning:
            console.warn(self.precision.warning)
        self.amp_dtype = self.precision.dtype
        self.channels_last = config.channels_last
        model = place_model(create_model(config.model, len(self.train_index.classes)), self.device,
                            self.channels_last)
        self.peak_lr = scaled_lr(config.lr, self.plan.global_batch)
        optimizer = create_optimizer(model, self.peak_lr, config.momentum, config.weight_decay, self.device)
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.state = TrainState(model, optimizer, scaler)
        self.resumed_at: Optional[float] = None
        if snapshot is not None:
            self.state.apply(snapshot)
            preempt.steps_done = self.state.step
            self.resumed_at = snapshot["saved_at"]
            self.warn_about_changes(snapshot)
        del snapshot

        self.build_loaders()
        self.total_steps = self.sampler.steps * config.epochs
        self.warmup_steps = round(config.warmup_epochs * self.sampler.steps)
        self.sample_log = SampleLog(os.environ.get(SAMPLE_LOG_VAR), env.rank, env.world_size)
        self.writer = CheckpointWriter(self.checkpoints, config.async_checkpoint, self.device)
        self.last_save = time.monotonic()

        data.share_heap_with_workers()
        for loader in ([] if config.evaluate else [self.train_loader]) + [self.val_loader]:
            data.start_workers(loader)  # now, while this process has one thread: see start_workers
        distributed.init_process_group(env, self.device, config.dist_timeout)
        self.check_same_checkpoint()
        if env.is_main and not config.evaluate:  # the inputs passed every check: remember the file lists
            for role, index in (("train", self.train_index), ("val", self.val_index)):
                path = file_index.cache_path(config.checkpoints_path, role)
                try:
                    if not index.cached:
                        file_index.write_cache(index, path)
                except OSError as error:  # only a cache: the next start scans again
                    console.warn(f"could not write the file list cache {path}: {error.strerror or error}")
        # Compiled before DDP wraps it; the checkpoint keeps saving `model`, whose parameters the compiled
        # module shares, so its keys carry no `_orig_mod.` prefix and eager and compiled runs resume each other.
        wrapped: nn.Module = torch.compile(model) if config.compile else model
        if env.launched:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(wrapped, device_ids=device_ids)
        self.ctx = StepContext(wrapped, optimizer, scaler, nn.CrossEntropyLoss(label_smoothing=config.label_smoothing),
                               self.device, self.amp_dtype, self.channels_last)

    def build_loaders(self) -> None:
        """Train and val loaders; under --decode gpu their workers hand over bytes and `self.decoder`
        finishes each batch on the device."""
        c, env = self.config, self.env
        self.workers = c.workers if c.workers is not None else data.default_workers(env.local_world_size)
        pin = self.device.type == "cuda"
        ignored = preemption.signal_numbers(c.preempt_signals)  # by loader workers: see data._worker_init
        load, collate = gpu_decode.worker_functions(c.decode)
        self.decoder = None
        if c.decode == "gpu":
            if self.device.type != "cuda":
                self.console.warn("--decode gpu without a CUDA device: the main process decodes each batch on "
                                  "the CPU (slower than --decode cpu; meant for testing)")
            self.decoder = gpu_decode.BatchDecoder(c.image_size, self.device,
                                                   functools.partial(self.console.warn, every_rank=True))
        self.train_loader = data.train_loader(
            data.TrainDataset(self.train_index, c.image_size, c.seed, load), self.sampler, self.workers, pin,
            ignored, collate)
        self.val_loader = data.eval_loader(
            data.EvalDataset(self.val_index, c.image_size, c.eval_resize, load),
            c.batch_size, env.rank, env.world_size, self.workers, pin, ignored, collate)

    def warn_about_changes(self, snapshot: dict[str, Any]) -> None:
        changes = self.config.differences(snapshot["config"])
        if snapshot.get("global_batch") not in (None, self.plan.global_batch):
            changes.append(f"global batch: checkpoint {snapshot['global_batch']}, now {self.plan.global_batch}")
        for change in changes:
            self.console.warn(f"resumed run differs from its checkpoint, results will not match exactly: {change}")

    def check_same_checkpoint(self) -> None:
        """All ranks must continue from the same checkpoint (each loaded it on its own)."""
        if not self.env.launched or self.config.evaluate:
            return
        s = self.state
        mark = torch.tensor([s.step, s.tally.samples, self.resumed_at or 0.0], dtype=torch.float64)
        spread = distributed.all_reduce_max(torch.cat([mark, -mark]))
        if not torch.equal(spread[:3], -spread[3:]):
            raise RuntimeError(f"ranks loaded different checkpoints from {self.config.checkpoints_path} "
                               "(was it written to while this round started?)")

    # ------------------------------------------------------------------ reporting

    def describe(self) -> None:
        c, env = self.config, self.env
        interval = [f"every {c.checkpoint_every_steps} steps"] if c.checkpoint_every_steps else []
        interval += [f"every {c.checkpoint_every_seconds:g} s"] if c.checkpoint_every_seconds else []
        self.console.table("imagenet_elastic", [
            ("model", f"{c.model} ({count_parameters(self.state.model) / 1e6:.2f} M parameters)"),
            ("classes", str(len(self.train_index.classes))),
            ("train images", describe_index(self.train_index)),
            ("val images", describe_index(self.val_index)),
            ("world size", f"{env.world_size} ({env.local_world_size} per node), device {self.device}"),
            ("launcher", f"{env.launcher}, rendezvous {env.master_addr}:{env.master_port}" if env.launched
             else "none (single process)"),
            ("global batch", self.plan.describe()),
            ("learning rate", f"{self.peak_lr:.6g} = {c.lr:g} x {self.plan.global_batch}/256, "
                              f"warmup {self.warmup_steps} steps, cosine over {self.total_steps}"),
            ("steps per epoch", str(self.sampler.steps)),
            ("precision", self.precision.describe()),
            ("channels_last / compile", f"{self.channels_last} / {c.compile}"),
            ("decode", "in loader workers" if self.decoder is None else f"batched on {self.device} (--decode gpu)"),
            ("threads / loader workers", f"{self.threads} / {self.workers} per process"),
            ("checkpoints", f"{c.checkpoints_path} (each epoch{''.join(', ' + i for i in interval)}; "
                            f"{'background' if c.async_checkpoint else 'synchronous'} writes)"),
            ("preemption", f"{', '.join(c.preempt_signals) or 'no signals'}: checkpoint and exit "
                           f"{PREEMPTED_EXIT}" + (", then requeue the Slurm job" if c.requeue_on_preempt else "")),
        ])

    # ------------------------------------------------------------------ the two things a run does

    def validate(self) -> EvalResult:
        """The model the checkpoint saves: rank 0's weights and BatchNorm statistics, on every rank.

        Eager even under --compile: validation's mode and its last, smaller batch would each cost a
        recompilation, for a pass over 4% as many images as an epoch's training.
        """
        distributed.broadcast_buffers(self.state.model)
        return evaluate(self.ctx, self.state.model, self.on_device(self.val_loader))

    def on_device(self, loader: DataLoader) -> Iterator[list]:
        return device_batches(loader, self.device, self.decoder)

    def fit(self) -> None:
        c, state = self.config, self.state
        if self.resume_from:
            where = f", {state.tally.samples} samples into epoch {state.epoch + 1}" if state.tally.samples else ""
            self.console.info(f"resuming from {self.resume_from}: {state.epoch} epochs done{where}, "
                              f"best val top-1 {state.best_top1:.2f}%")
            if self.env.is_main:
                metrics.write(c.checkpoints_path, state.history)
        elif c.resume == "auto" or self.env.restart_count > 0:
            self.console.info(f"no checkpoint at {self.checkpoints.last_path}: starting fresh")
        if self.env.is_main:
            for path in self.checkpoints.stale_temp_files():  # safe: we hold the folder's lock
                self.console.warn(f"removing {path}, left by a write that was interrupted")
                os.unlink(path)
        if state.epoch >= c.epochs:
            self.console.info(f"nothing to do: the checkpoint already completed {state.epoch} of {c.epochs} epochs")
            return
        for epoch in range(state.epoch, c.epochs):
            row = self.run_epoch(epoch)
            state.epoch = epoch + 1
            state.tally = EpochTally()
            is_best = row["val_top1"] > state.best_top1
            state.best_top1 = max(state.best_top1, row["val_top1"])
            state.history.append(row)
            self.save(epoch_end=True, is_best=is_best)
            self.console.info(
                f"epoch {state.epoch}/{c.epochs}: train loss {row['train_loss']:.4f} | val loss {row['val_loss']:.4f} "
                f"top-1 {row['val_top1']:.2f}% top-5 {row['val_top5']:.2f}% ({row['val_samples']} images) | "
                f"{row['images_per_sec']:.1f} img/s | {row['epoch_seconds']:.1f} s" + (" | best" if is_best else ""))
            if state.epoch < c.epochs and distributed.agree([self.preempt.received is not None])[0]:
                self.stop()
        self.settle_saves()  # the run succeeded only once its last checkpoint is on disk

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        """Train the rest of the epoch (all of it, or what a mid-epoch checkpoint left), then validate."""
        c, state, plan, tally = self.config, self.state, self.plan, self.state.tally
        start = time.perf_counter()
        self.sampler.set_epoch(epoch, tally.samples)
        slices = plan.micro_slices(self.env.rank)
        pending = PendingSteps(self.device)
        self.ctx.model.train()
        with self.console.progress(f"epoch {epoch + 1}/{c.epochs}", self.sampler.steps, tally.steps) as progress:
            for micro_batches in step_groups(self.on_device(self.train_loader), plan.accum):
                lr = lr_at(state.step, self.peak_lr, self.warmup_steps, self.total_steps)
                loss = train_step(self.ctx, micro_batches, slices, plan.share, lr, c.seed, state.step)
                self.sample_log.record(epoch, state.step, (i for batch in micro_batches for i in batch[2].tolist()))
                state.step += 1
                self.preempt.steps_done = state.step
                pending.add(loss)
                if self.resumed_at is not None:
                    self.report_resume_time()
                step_in_epoch = tally.steps + pending.steps
                if progress.wants_stats(step_in_epoch):  # the only host sync of the loop
                    rate = pending.steps * plan.global_batch / (time.perf_counter() - pending.start)
                    progress.update(step_in_epoch, f"loss {loss.item():.4f} lr {lr:.5f} {rate:.1f} img/s")
                else:
                    progress.update(step_in_epoch)
                stop, timely, write_failed = distributed.agree([
                    self.preempt.received is not None, self.checkpoint_due_by_time(), self.writer.failed])
                if write_failed:
                    self.raise_write_failure()
                if stop or timely or self.checkpoint_due_by_steps():
                    pending.fold_into(tally, plan.global_batch, self.env.world_size)
                    self.save(epoch_end=False)
                if stop:
                    self.stop()
        pending.fold_into(tally, plan.global_batch, self.env.world_size)
        val = self.validate()
        return {
            "epoch": epoch + 1,
            "train_loss": tally.loss_sum / tally.steps if tally.steps else float("nan"),
            "val_loss": val.loss,
            "val_top1": val.top1,
            "val_top5": val.top5,
            "val_samples": val.samples,
            "lr": lr_at(state.step - 1, self.peak_lr, self.warmup_steps, self.total_steps),
            "images_per_sec": tally.samples / tally.seconds if tally.seconds else 0.0,
            "world_size": self.env.world_size,
            "global_batch": plan.global_batch,
            "epoch_seconds": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------ checkpoints and stopping

    def checkpoint_due_by_steps(self) -> bool:
        every = self.config.checkpoint_every_steps
        return bool(every) and self.state.step % every == 0

    def checkpoint_due_by_time(self) -> bool:
        every = self.config.checkpoint_every_seconds
        return bool(every) and time.monotonic() - self.last_save >= every

    def save(self, epoch_end: bool, is_best: bool = False) -> None:
        """Rank 0 hands the state to its writer (metrics.jsonl follows an epoch's checkpoint). A
        synchronous save is on disk before any rank goes on; a background one is waited for by the
        next save, a stop, the end of the run and `close`."""
        if self.env.is_main:
            snapshot = self.state.capture(self.config.to_dict(), self.checkpoint_meta())
            after = functools.partial(metrics.write, self.config.checkpoints_path, list(self.state.history))
            self.writer.submit(snapshot, self.state.epoch if epoch_end else None, is_best,
                               after if epoch_end else None)
        if not self.writer.background:
            self.settle_saves()
        self.last_save = time.monotonic()

    def settle_saves(self) -> None:
        """Every rank waits until rank 0's checkpoint is on disk; if it could not be written, every
        rank stops (exit 74), so a stop or a finished run never outruns its checkpoint."""
        failed = self.env.is_main and self.writer.wait() is not None
        if distributed.agree([failed])[0]:
            self.raise_write_failure()

    def raise_write_failure(self) -> None:
        """Rank 0 raises the writer's error (one line for a storage error); the others end quietly."""
        if self.env.is_main:
            raise self.writer.take_error()
        raise StorageError("rank 0 could not write a checkpoint")

    def stop(self) -> None:
        """Called on every rank after the agreed stop's checkpoint is on disk."""
        c, flag = self.config, self.preempt
        self.settle_saves()
        came = (f"{flag.received} came after step {flag.received_after}" if flag.received
                else "a preemption signal came to another rank")
        self.console.info(f"{came}; stopped after step {self.state.step} with a checkpoint in "
                          f"{self.checkpoints.last_path}; exiting with code {PREEMPTED_EXIT}")
        if c.requeue_on_preempt and self.env.is_main:
            job = preemption.slurm_job_to_requeue(os.environ)
            problem = preemption.requeue_slurm_job(job)
            self.console.info(f"requeued Slurm job {job}" if not problem else f"could not requeue {job}: {problem}")
        raise Preempted()

    def report_resume_time(self) -> None:
        """Said once, after the first step of a resumed run: what a restart cost in wall time."""
        self.console.info(f"first step {time.time() - self.resumed_at:.1f} s after the checkpoint was written "
                          f"(restart + load {self.load_seconds:.2f} s + first step)")
        self.resumed_at = None

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"model_name": self.config.model, "classes": list(self.train_index.classes),
                "world_size": self.env.world_size, "global_batch": self.plan.global_batch}

    def close(self) -> None:
        """Drop DDP and loaders before the process group goes (see distributed.destroy_process_group)."""
        self.ctx = self.train_loader = self.val_loader = None  # type: ignore[assignment]
        unreported = self.writer.close()  # the save in flight ends before the lock and the process group go
        if unreported is not None:
            self.console.warn(f"the checkpoint being written when the run stopped was not saved: "
                              f"{one_line(unreported)}")
        self.sample_log.close()
        self.lock.release()


def run(config: Config, env: DistEnv) -> None:
    console = Console(env.is_main, config.log_interval, env.rank)
    preempt = PreemptionFlag(config.preempt_signals)  # first: a signal during start-up is not lost
    trainer = None
    try:
        trainer = Trainer(config, env, console, preempt)
        trainer.describe()
        if config.evaluate:
            result = trainer.validate()
            console.result({"checkpoint": trainer.resume_from, "val_loss": result.loss, "val_top1": result.top1,
                            "val_top5": result.top5, "val_samples": result.samples})
        else:
            trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        data.stop_loader_workers()
        distributed.destroy_process_group()
        # The rank is ending, with its own exit code (0, 2, 75 or a crash's): a signal now (torchrun's
        # second one, or a spawn parent stopping the ranks after another one failed) would only turn
        # that code into -15 and hide why it ended.
        preempt.ignore_from_now()

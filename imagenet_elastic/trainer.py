"""The run from start to finish: inputs checked, state restored, epochs trained, checkpoints committed."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imagenet_elastic import checkpoint, data, distributed, metrics
from imagenet_elastic.checkpoint import CheckpointManager
from imagenet_elastic.config import Config
from imagenet_elastic.console import Console
from imagenet_elastic.distributed import DistEnv
from imagenet_elastic.engine import EvalResult, StepContext, evaluate, train_one_epoch
from imagenet_elastic.errors import UserError
from imagenet_elastic.model import count_parameters, create_model, create_optimizer
from imagenet_elastic.sampler import TrainBatchSampler
from imagenet_elastic.schedule import lr_at, scaled_lr
from imagenet_elastic.state import TrainState, check_compatible


def resolve_amp(amp: str, device: torch.device) -> Optional[torch.dtype]:
    """bf16 where the hardware has it (every CPU, Ampere and newer GPUs), else fp16."""
    if amp == "auto":
        amp = "bf16" if device.type == "cpu" or torch.cuda.is_bf16_supported() else "fp16"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def default_workers(local_world_size: int) -> int:
    return min(8, max(1, distributed.available_cores() // max(1, local_world_size) - 1))


def seed_epoch(seed: int, epoch: int, rank: int) -> None:
    """Model-side randomness (dropout, drop-path) restarts from (seed, epoch, rank) every epoch,
    so an epoch-boundary resume needs no RNG state from other ranks."""
    torch.manual_seed(int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0]))


class Trainer:
    def __init__(self, config: Config, env: DistEnv, console: Console) -> None:
        self.config, self.env, self.console = config, env, console
        self.threads = distributed.configure_threads(config.threads, env.local_world_size)
        self.device = distributed.select_device(config.device, env)

        # Every check that can fail on user input runs before the process group exists.
        train_dir, val_dir = data.resolve_split_dirs(config.data, config.val_path)
        self.train_index = data.scan_image_folder(train_dir, "train")
        self.val_index = data.scan_image_folder(val_dir, "val")
        data.check_same_classes(self.train_index, self.val_index)
        self.checkpoints = CheckpointManager(config.checkpoints_path, config.keep_checkpoints)
        if not config.evaluate:
            checkpoint.check_writable(config.checkpoints_path)
        self.resume_from = self.checkpoints.resume_path(config.resume, restarted=env.restart_count > 0)
        if config.evaluate and self.resume_from is None:
            raise UserError("--evaluate needs a checkpoint: pass --resume PATH")
        snapshot = checkpoint.load(self.resume_from) if self.resume_from else None
        if snapshot is not None:
            check_compatible(snapshot, self.resume_from, config.model, self.train_index.classes)

        torch.manual_seed(config.seed)
        model = create_model(config.model, len(self.train_index.classes)).to(self.device)
        self.amp_dtype = resolve_amp(config.amp, self.device)
        self.channels_last = config.channels_last if config.channels_last is not None else self.device.type == "cuda"
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.global_batch = config.batch_size * env.world_size
        self.peak_lr = scaled_lr(config.lr, self.global_batch)
        optimizer = create_optimizer(model, self.peak_lr, config.momentum, config.weight_decay)
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.state = TrainState(model, optimizer, scaler)
        if snapshot is not None:
            self.state.apply(snapshot)
            for change in config.differences(snapshot["config"]):
                console.warn(f"resumed run differs from its checkpoint, results will not match exactly: {change}")
        self.resumed_at = snapshot["saved_at"] if snapshot else None
        del snapshot

        workers = config.workers if config.workers is not None else default_workers(env.local_world_size)
        pin = self.device.type == "cuda"
        self.sampler = TrainBatchSampler(len(self.train_index), self.global_batch, env.rank, env.world_size,
                                         config.seed, config.max_steps_per_epoch)
        self.train_loader = data.train_loader(
            data.TrainDataset(self.train_index, config.image_size, config.seed), self.sampler, workers, pin)
        self.val_loader = data.eval_loader(
            data.EvalDataset(self.val_index, config.image_size, config.eval_resize),
            config.batch_size, env.rank, env.world_size, workers, pin)
        self.workers = workers
        self.total_steps = self.sampler.steps * config.epochs
        self.warmup_steps = round(config.warmup_epochs * self.sampler.steps)

        distributed.init_process_group(env, self.device, config.dist_timeout)
        wrapped: nn.Module = model
        if env.launched:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=device_ids)
        self.ctx = StepContext(wrapped, optimizer, scaler, nn.CrossEntropyLoss(label_smoothing=config.label_smoothing),
                               self.device, self.amp_dtype, self.channels_last)

    # ------------------------------------------------------------------ reporting

    def describe(self) -> None:
        c, env = self.config, self.env
        amp = {torch.bfloat16: "bf16", torch.float16: "fp16 + GradScaler", None: "off (fp32)"}[self.amp_dtype]
        self.console.table("imagenet_elastic", [
            ("model", f"{c.model} ({count_parameters(self.state.model) / 1e6:.2f} M parameters)"),
            ("classes", str(len(self.train_index.classes))),
            ("train images", f"{len(self.train_index)} in {self.train_index.root}"),
            ("val images", f"{len(self.val_index)} in {self.val_index.root}"),
            ("world size", f"{env.world_size} ({env.local_world_size} per node), device {self.device}"),
            ("launcher", f"{env.launcher}, rendezvous {env.master_addr}:{env.master_port}" if env.launched
             else "none (single process)"),
            ("global batch", f"{self.global_batch} = {c.batch_size} per process x {env.world_size}"),
            ("learning rate", f"{self.peak_lr:.6g} = {c.lr:g} x {self.global_batch}/256, "
                              f"warmup {self.warmup_steps} steps, cosine over {self.total_steps}"),
            ("steps per epoch", str(self.sampler.steps)),
            ("amp", amp),
            ("channels_last", str(self.channels_last)),
            ("threads / loader workers", f"{self.threads} / {self.workers} per process"),
            ("checkpoints", c.checkpoints_path),
        ])

    # ------------------------------------------------------------------ the two things a run does

    def validate(self) -> EvalResult:
        return evaluate(self.ctx, self.state.model, self.val_loader)

    def fit(self) -> None:
        c, state = self.config, self.state
        if self.resume_from:
            self.console.info(f"resuming from {self.resume_from}: {state.epoch} epochs done, "
                              f"best val top-1 {state.best_top1:.2f}%")
            if self.env.is_main:
                metrics.write(c.checkpoints_path, state.history)
        elif c.resume == "auto" or self.env.restart_count > 0:
            self.console.info(f"no checkpoint at {self.checkpoints.last_path}: starting fresh")
        if self.env.is_main:
            for path in self.checkpoints.stale_temp_files():
                self.console.warn(f"removing {path}, left by a write that was interrupted")
                os.unlink(path)
        if state.epoch >= c.epochs:
            self.console.info(f"nothing to do: the checkpoint already completed {state.epoch} of {c.epochs} epochs")
            return
        for epoch in range(state.epoch, c.epochs):
            row = self.run_epoch(epoch)
            state.epoch = epoch + 1
            is_best = row["val_top1"] > state.best_top1
            state.best_top1 = max(state.best_top1, row["val_top1"])
            state.history.append(row)
            if self.env.is_main:
                self.checkpoints.save(state.capture(c.to_dict(), self.checkpoint_meta()), state.epoch, is_best)
                metrics.write(c.checkpoints_path, state.history)
            self.console.info(
                f"epoch {state.epoch}/{c.epochs}: train loss {row['train_loss']:.4f} | val loss {row['val_loss']:.4f} "
                f"top-1 {row['val_top1']:.2f}% top-5 {row['val_top5']:.2f}% ({row['val_samples']} images) | "
                f"{row['images_per_sec']:.1f} img/s | {row['epoch_seconds']:.1f} s" + (" | best" if is_best else ""))

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        c = self.config
        start = time.perf_counter()
        seed_epoch(c.seed, epoch, self.env.rank)
        self.sampler.set_epoch(epoch)
        lr_for_step = lambda step: lr_at(step, self.peak_lr, self.warmup_steps, self.total_steps)  # noqa: E731
        with self.console.progress(f"epoch {epoch + 1}/{c.epochs}", len(self.sampler)) as progress:
            train = train_one_epoch(self.ctx, self.train_loader, lr_for_step, self.state.step, progress,
                                    self.global_batch)
        self.state.step += train.steps
        val = self.validate()
        return {
            "epoch": epoch + 1,
            "train_loss": train.loss,
            "val_loss": val.loss,
            "val_top1": val.top1,
            "val_top5": val.top5,
            "val_samples": val.samples,
            "lr": lr_for_step(self.state.step - 1),
            "images_per_sec": train.steps * self.global_batch / train.seconds if train.seconds else 0.0,
            "world_size": self.env.world_size,
            "global_batch": self.global_batch,
            "epoch_seconds": time.perf_counter() - start,
        }

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"model_name": self.config.model, "classes": list(self.train_index.classes),
                "world_size": self.env.world_size, "global_batch": self.global_batch}

    def close(self) -> None:
        """Drop DDP and loaders before the process group goes (see distributed.destroy_process_group)."""
        self.ctx = self.train_loader = self.val_loader = None  # type: ignore[assignment]


def run(config: Config, env: DistEnv) -> None:
    console = Console(env.is_main, config.log_interval)
    trainer = None
    try:
        trainer = Trainer(config, env, console)
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
        distributed.destroy_process_group()


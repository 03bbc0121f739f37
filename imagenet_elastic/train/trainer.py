"""A rank's run (`run`, cli.py's entry point): `build` makes its parts in train/build.py's order, and the Trainer
trains them: epochs, validation, checkpoints and the stop every rank agrees on."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from imagenet_elastic.checkpoint.saving import Checkpointer
from imagenet_elastic.checkpoint.store import BEST
from imagenet_elastic.config import RESUME_AUTO, Config, yaml_file
from imagenet_elastic.data.device.feed import LoaderWaits, device_batches, step_groups
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sources import Source
from imagenet_elastic.errors import (
    INTERRUPTED_EXIT,
    PREEMPTED_EXIT,
    Preempted,
    RendezvousError,
    UserError,
    counted,
    one_line,
)
from imagenet_elastic.launch import distributed, preemption
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.models.compile import Compilation
from imagenet_elastic.report import metrics, samplelog
from imagenet_elastic.report.console import Console, EpochProgress, clock
from imagenet_elastic.report.restart_cost import RestartCost, process_started_at
from imagenet_elastic.report.sinks import Sinks
from imagenet_elastic.train import startup_table
from imagenet_elastic.train.build import (
    Loaders,
    Run,
    Training,
    build_loaders,
    check_inputs,
    fit_micro_batches,
    join_job,
    prepare_compile,
    prepare_training,
    share_checkpoint,
    step_context,
)
from imagenet_elastic.train.state import EpochTally, PendingSteps
from imagenet_elastic.train.step import StepContext, evaluate, train_step


@dataclass(frozen=True)
class Reports:
    """Beyond the console: the curves' sinks, the sample log, the first step's compile and restart facts."""

    sinks: Sinks
    sample_log: samplelog.SampleLog
    compilation: Compilation
    restart_cost: Optional[RestartCost] = None  # a resumed run's


class Trainer:
    def __init__(self, run: Run, training: Training, loaders: Loaders, ctx: StepContext, checkpointer: Checkpointer,
                 reports: Reports) -> None:
        self.config, self.env, self.console, self.preempt = run.config, run.env, run.console, run.preempt
        self.state, self.plan, self.sampler = training.state, training.plan, training.sampler
        self.training, self.loaders, self.ctx, self.checkpointer = training, loaders, ctx, checkpointer
        self.sinks, self.sample_log, self.compilation = reports.sinks, reports.sample_log, reports.compilation
        self.restart_cost = reports.restart_cost  # said after the first step of a resumed run, then dropped
        self.waits, self.since_log = LoaderWaits(), EpochTally()  # since_log: the steps since the last log line
        state, resumed = training.state, training.resume_from
        self.resumed_into = state.epoch if resumed else None  # marked in its metrics row
        # where the run starts: the checkpoint kept until this run saves one
        self.started_from = (resumed, (state.step, state.epoch, state.tally.samples)) if resumed else None
        # this process trained a step; the run finished; it saved a checkpoint (its first is followed by config.yaml)
        self.stepped = self.finished = self.saved_once = False

    def fit(self) -> None:
        """Train the epochs left, with Ctrl-C a stop like a preemption signal's while they train (launch/
        preemption.py); one that stops at once (a second) says what was kept and lost first."""
        try:
            self.preempt.training_began = self.preempt.checkpoint_on_interrupt = True
            self.train_epochs()
        except KeyboardInterrupt:
            self.say_what_an_interrupt_kept()
            raise
        except RuntimeError as error:
            if not (self.preempt.interrupted and distributed.peer_left(error)):
                raise
            # a rank stopped at once on the second Ctrl-C while this one waited in a collective: the same stop here
            # (the second Ctrl-C reaches this rank's handler only after the collective fails)
            self.say_what_an_interrupt_kept()
            raise KeyboardInterrupt from None
        finally:
            self.preempt.checkpoint_on_interrupt = False

    def train_epochs(self) -> None:
        c, state = self.config, self.state
        self.say_where_it_starts()
        if state.epoch >= c.epochs:  # the checkpoint trained them all (a smaller --epochs: more)
            done = (f"all {counted(c.epochs, 'epoch')} of --epochs {c.epochs}" if state.epoch == c.epochs else
                    f"{counted(state.epoch, 'epoch')}, more than --epochs {c.epochs}; a larger --epochs trains on")
            self.console.info(f"nothing to do: the checkpoint already completed {done}")
            self.finished = True
            return
        for epoch in range(state.epoch, c.epochs):
            row = self.run_epoch(epoch)
            state.epoch, state.tally = epoch + 1, EpochTally()
            top1, ema = scored(row)
            is_best = top1 > state.best_top1
            state.best_top1 = max(state.best_top1, top1)
            state.history.append(row)
            self.sinks.epoch(row)
            self.save(epoch_end=True, is_best=is_best, best_of="model_ema" if ema else "model")
            ema = f" | EMA top-1 {row['val_top1_ema']:.2f}%" if "val_top1_ema" in row else ""
            taught = f" (task {row['train_task_loss']:.4f}, distillation {row['train_distill_loss']:.4f})" \
                if "train_distill_loss" in row else ""
            self.console.info(f"epoch {state.epoch}/{c.epochs}: train loss {row['train_loss']:.4f}{taught} | val loss "
                              f"{row['val_loss']:.4f} top-1 {row['val_top1']:.2f}% top-5 {row['val_top5']:.2f}% "
                              f"({row['val_samples']} images){ema} | {row['images_per_sec']:.1f} img/s | "
                              f"{row['epoch_seconds']:.1f} s" + (" | best" if is_best else ""))
            if state.epoch < c.epochs and distributed.agree([self.preempt.received is not None])[0]:
                self.stop()
        self.preempt.checkpoint_on_interrupt = False  # trained: a Ctrl-C now loses nothing by stopping at once
        self.checkpointer.settle()  # the run succeeded only once its last checkpoint is on disk
        self.finished = True
        self.say_where_the_best_is()

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        """Train the rest of the epoch (all of it, or what a mid-epoch checkpoint left), then validate."""
        c, state, plan, tally, r = self.config, self.state, self.plan, self.state.tally, self.training
        start = time.perf_counter()
        self.sampler.set_epoch(epoch, tally.samples)
        steps = tally.steps + self.sampler.steps_left  # where a checkpoint's were at another global batch, as they were
        pending = PendingSteps(self.ctx.input.device, self.ctx.parts)  # losses stay on the device until needed
        self.ctx.model.train()
        with self.console.progress(f"epoch {epoch + 1}/{c.epochs}", steps, tally.steps) as progress:
            for micro_batches in step_groups(self.waits.timed(self.on_device(self.loaders.train)), plan.accum):
                lr, micro = r.schedule.at(state.step), r.micro
                with self.until_first_step():
                    if micro.auto:  # the step is retried with smaller micro-batches on an out-of-memory error
                        loss = micro.step(self.ctx, micro_batches, lr, c.seed, state.step)
                    else:  # the loader's micro-batches as they are
                        loss = train_step(self.ctx, micro_batches, micro.slices, micro.plan.share, lr, c.seed,
                                          state.step)
                self.sample_log.record(epoch, state.step, (i for b in micro_batches for i in b.indices.tolist()))
                state.step += 1
                state.update_average(c.model_ema_steps)
                self.preempt.steps_done = state.step
                pending.add(loss)
                if not self.stepped:
                    self.after_first_step()
                step_in_epoch = tally.steps + pending.steps
                if step_in_epoch % c.log_interval == 0 or step_in_epoch == steps:  # the same on every rank
                    self.fold(pending)  # reading the loss waits for the device: log steps only
                    self.log_step(progress, epoch, (step_in_epoch, steps), lr)
                else:
                    progress.update(step_in_epoch)
                stop, save = self.checkpointer.at_step_end(state.step, self.preempt.received is not None)
                self.preempt.stepped = True
                if save:
                    self.fold(pending)
                    self.save(epoch_end=False)
                if stop:
                    self.stop()
        self.fold(pending)
        return metrics.epoch_row(epoch=epoch + 1, step=state.step, tally=tally, validated=self.validate(),
                                 lr=r.schedule.at(state.step - 1), train_size=c.train_sizes(epoch),
                                 world_size=self.env.world_size, global_batch=plan.global_batch,
                                 seconds=time.perf_counter() - start, resumed=epoch == self.resumed_into)

    def until_first_step(self) -> contextlib.AbstractContextManager:
        """This process's first step, its compile included (minutes on a GPU, beyond a scheduler's grace period), is
        start-up's last part: a preemption signal stops at once, as nothing was trained since the checkpoint."""
        return self.preempt.starting() if not self.stepped else contextlib.nullcontext()

    def after_first_step(self) -> None:
        """Once per process, on every rank: what compiling did, and what the restart cost up to this step's end."""
        stepped, self.stepped = time.time(), True
        self.compilation.after_first_step()
        if self.restart_cost is not None:
            autotuned = self.ctx.input.device.type == "cuda" and torch.backends.cudnn.benchmark
            self.console.info(self.restart_cost.describe(stepped, self.compilation.first_step(autotuned)))
            self.restart_cost = None

    def fold(self, pending: PendingSteps) -> None:
        """Pending steps into the epoch's tally (one all-reduce), and into what the next log line reports."""
        added = pending.fold_into(self.state.tally, self.plan.global_batch, self.env.world_size)
        self.since_log.add(added)
        if not math.isfinite(added.loss_sum):  # the same sum on every rank: every rank checks, and stops, alike
            self.stop_if_diverged(added.loss_sum)

    def stop_if_diverged(self, loss: float) -> None:
        """Weights gone NaN or inf (too high an LR, no --clip-grad-norm) stay so: the run stops before a checkpoint
        holds them, and last.pt stays the last good one. A non-finite loss alone is no divergence: under fp16 the
        GradScaler skips that step."""
        weights = [torch.linalg.vector_norm(p.detach(), float("inf")) for p in self.state.model.parameters()]
        if bool(torch.stack(weights).isfinite().all()):
            return
        self.checkpointer.settle()  # a write in flight holds earlier, finite weights: it counts
        path, saved = self.last_kept()
        remedy = f"a lower --lr (now {self.config.lr:g}) or --clip-grad-norm"
        kept = (f"{path} (step {saved[0]}) stays the last, and --resume continues from it with {remedy}"
                if saved is not None else f"none was written before either: start again with {remedy}")
        raise UserError(f"training diverged by step {self.state.step}: the loss is {loss} and the weights hold NaN or "
                        f"inf, so no checkpoint is written from them; {kept}")

    def last_kept(self) -> tuple[str, Optional[tuple[int, int, int]]]:
        """The checkpoint on disk a --resume would continue from, and its (step, epochs, samples into the epoch)."""
        path, saved = self.checkpointer.files.last_path, self.checkpointer.writer.on_disk
        if saved is None and self.started_from is not None:
            path, saved = self.started_from
        return path, saved

    def log_step(self, progress: EpochProgress, epoch: int, at: tuple[int, int], lr: float) -> None:
        """The steps since the last log line: mean loss over all ranks, images/s, the share of time spent waiting
        for the loader (the first thing to check when a GPU is starved), ETAs. `at`: this step of the epoch's."""
        (step_in_epoch, steps), since = at, self.since_log
        row = metrics.step_row(self.state.step, epoch + step_in_epoch / steps, since, lr, self.waits.take())
        per_step = max(since.seconds, 1e-9) / since.steps
        left_in_epoch = (steps - step_in_epoch) * per_step
        left_in_run = left_in_epoch + (self.config.epochs - epoch - 1) * self.sampler.steps * per_step
        taught = f" (distillation {row['distill_loss']:.4f})" if "distill_loss" in row else ""
        progress.update(step_in_epoch, f"loss {row['loss']:.4f}{taught} lr {lr:.5f} {row['images_per_sec']:.1f} img/s "
                                       f"data wait {row['data_wait']:.0%} | ETA epoch {clock(left_in_epoch)}, "
                                       f"run {clock(left_in_run)}")
        self.sinks.step(row)
        self.since_log = EpochTally()

    def validate(self) -> dict[str, Any]:
        """The model the checkpoint saves (rank 0's weights and BatchNorm statistics, on every rank), and its
        average under --model-ema. Eager even under --compile: validation's mode and its last, smaller batch would
        each cost a recompilation, for a pass over 4% as many images as an epoch's training."""
        models = {"": self.state.model}
        if self.state.ema is not None:
            models["_ema"] = self.state.ema.module
        results: dict[str, Any] = {}
        for suffix, model in models.items():
            distributed.broadcast_buffers(model)
            val = evaluate(self.ctx.input, model, self.on_device(self.loaders.val, "validation"),
                           self.config.val_flip_average, fit=self.training.micro)
            results.update({f"val_loss{suffix}": val.loss, f"val_top1{suffix}": val.top1,
                            f"val_top5{suffix}": val.top5})
            results["val_samples"] = val.samples
        return results

    def on_device(self, loader: DataLoader, kind: str = "training") -> Iterator[Batch]:
        return device_batches(loader, self.ctx.input.device, self.loaders.feed.decoder,
                              functools.partial(self.decode_failed, kind))

    def decode_failed(self, kind: str, batch: Batch, error: str, again: bool) -> None:
        """--decode gpu ran out of memory decoding `batch` for `kind`: MicroBatches.decode_failed ends or makes room."""
        what = f"decoding a batch of {len(batch)} images for " + (
            f"training step {self.state.step + 1}" if kind == "training" else "validation")
        self.training.micro.decode_failed(kind, what, error, again)

    def save(self, epoch_end: bool, is_best: bool = False, best_of: Optional[str] = None) -> None:
        """`best_of`: which weights scored the epoch's top-1 (model or model_ema); None mid-epoch."""
        state = self.state
        self.sinks.flush()  # the curves up to this step are on disk with the checkpoint
        folder = self.config.checkpoints_path
        then = [functools.partial(metrics.write, folder, list(state.history))] if epoch_end else []  # its epochs' rows
        cache = self.compilation.cache_write()  # graphs compiled since the first step
        if cache is not None:
            then.append(cache)
        if not self.saved_once:  # this run's first checkpoint: its settings, and the trackers' runs it now holds
            then += [functools.partial(yaml_file.write, folder, self.config), self.sinks.runs.forget_pending]
            self.saved_once = True
        self.checkpointer.save(lambda: state.capture(self.config.to_dict(), self.checkpoint_meta(best_of)),
                               epoch=state.epoch if epoch_end else None, is_best=is_best, then=then)

    def checkpoint_meta(self, best_of: Optional[str]) -> dict[str, Any]:
        return {"model_name": self.config.model, "run_id": self.training.run_id, "classes": list(self.training.classes),
                "best_of": best_of, "world_size": self.env.world_size, "global_batch": self.plan.global_batch,
                "trackers": self.sinks.tracker_runs, **self.training.micro.saved(),
                "decoding": self.loaders.feed.decoding.saved(), "data": self.training.data,
                "teacher": self.training.teacher.identity() if self.training.teacher is not None else None}

    def stop(self) -> None:
        """Called on every rank at the agreed step boundary, after the stop's checkpoint was handed over. A Ctrl-C's
        stop exits 130 and requeues nothing: someone asked for it."""
        c, flag = self.config, self.preempt
        self.checkpointer.settle()
        code = INTERRUPTED_EXIT if flag.interrupted else PREEMPTED_EXIT
        came = (f"{'Ctrl-C' if flag.interrupted else flag.received} came after step {flag.received_after}"
                if flag.received else "a preemption signal came to another rank")
        self.console.info(f"{came}; stopped after step {self.state.step} with a checkpoint in "
                          f"{self.checkpointer.files.last_path}; exiting with code {code}")
        if not flag.interrupted:
            requeue_if_asked(c, self.env, self.console)
        raise Preempted(code)

    def say_what_an_interrupt_kept(self) -> None:
        """After a Ctrl-C that stopped at once: the checkpoint on disk (the write in flight ends first, and counts;
        another Ctrl-C abandons it) and the steps trained since, which are lost."""
        writer = self.checkpointer.writer
        self.preempt.checkpoint_on_interrupt = False  # a Ctrl-C during the wait stops it at once
        if writer.writing:
            self.console.info("waiting for the checkpoint write in flight to end (Ctrl-C again abandons it)")
        abandoned = ""
        try:
            writer.wait()
        except KeyboardInterrupt:
            if writer.abandon():
                abandoned = "abandoning the checkpoint write in flight (its temp file is removed at the next start); "
        path, saved = self.last_kept()
        step = self.state.step
        if saved is None:
            self.console.info(f"Ctrl-C: stopped at once after step {step}, before the run's first checkpoint: "
                              + abandoned
                              + (f"lost: {counted(step, 'step')} trained" if step else "nothing trained, none lost"))
            return
        at, epochs, samples = saved
        where = f"{samples} samples into epoch {epochs + 1}" if samples else f"{counted(epochs, 'epoch')} done"
        lost = f"lost: {counted(step - at, 'step')} trained since" if step > at else "nothing lost"
        again = "; --resume continues from it" if path == self.checkpointer.files.last_path else ""
        self.console.info(f"Ctrl-C: stopped at once after step {step}; {abandoned}kept {path} (step {at}, {where}); "
                          f"{lost}{again}")

    def say_where_it_starts(self) -> None:
        """Where training continues from; rank 0 also tidies the folder it holds the lock of."""
        c, state, resume_from = self.config, self.state, self.training.resume_from
        if resume_from:
            where = f", {state.tally.samples} samples into epoch {state.epoch + 1}" if state.tally.samples else ""
            best = f"best val top-1 {state.best_top1:.2f}%" if state.best_top1 >= 0 else "no validation yet"
            self.console.info(f"resuming from {resume_from}: {counted(state.epoch, 'epoch')} done{where}, {best}")
            # metrics.jsonl as the checkpoint holds it: rows of epochs trained after it (by a run that died) go
            distributed.rank_0_does(lambda: metrics.write(c.checkpoints_path, list(state.history)))
        elif c.resume == RESUME_AUTO or self.env.restart_count > 0:
            self.console.info(f"no checkpoint at {self.checkpointer.files.last_path}: starting fresh")
        distributed.rank_0_does(lambda: self.checkpointer.remove_stale_temp_files(self.console.warn))

    def say_where_the_best_is(self) -> None:
        """Rank 0: the best epoch, and the file to export it from: best.pt, else its epoch_NNNN.pt where best.pt is
        damaged (by their zip directories: neither is loaded)."""
        found = best_epoch(self.state.history) if self.env.is_main else None
        if found is None:
            return
        row, ema = found
        files = self.checkpointer.files
        names = [BEST, f"epoch_{row['epoch']:04d}.pt"]
        best = files.readable(names)
        said = f"best val top-1 {row['val_top1_ema' if ema else 'val_top1']:.2f}% ({'EMA' if ema else 'raw'} " \
               f"weights) after epoch {row['epoch']}"
        if best is None:
            self.console.warn(f"{said}: no readable checkpoint holds it ({' and '.join(names)} in {files.folder} are "
                              "damaged or gone)")
            return
        self.console.info(f"{said}: {best}; weights and preprocessing for timm: imagenet-elastic export "
                          f"{shlex.quote(best)} OUT_DIR{' --ema' if ema else ''}")

    def close(self) -> None:
        """The write in flight ends, then DDP, loaders and tensors go, before the process group does
        (see distributed.destroy_process_group)."""
        unreported = self.checkpointer.writer.close()
        if unreported is not None:
            self.console.warn(f"the checkpoint being written when the run stopped was not saved: "
                              f"{one_line(unreported)}")
        self.sample_log.close()
        self.sinks.close(self.finished)
        self.ctx = self.loaders = self.state = self.training = None  # type: ignore[assignment]


def requeue_if_asked(config: Config, env: DistEnv, console: Console) -> None:
    """After a preemption's stop, with --requeue-on-preempt: rank 0 puts the Slurm job back in the queue. Where that
    fails the exit code stays 75 (the checkpoint is written; the same command resumes), with one warning line."""
    if not (config.requeue_on_preempt and env.is_main):
        return
    job = preemption.slurm_job_to_requeue(os.environ)  # None only before build's check of it
    problem = preemption.requeue_slurm_job(job) if job else "SLURM_JOB_ID is not set"
    if problem:
        console.warn(f"not requeued: `scontrol requeue {job or ''}` failed: {problem}; run the same command again")
    else:
        console.info(f"requeued Slurm job {job}")


def stopped_at_once(config: Config, env: DistEnv, console: Console, signal_name: str) -> Preempted:
    """A preemption signal before the first step was done (launch/preemption.py): the stop a checkpointed one is,
    without the checkpoint (nothing trained to write), exit 75. Requeued unless it is SIGTERM: at start-up that is
    also how torchrun, spawn and srun --kill-on-bad-exit stop the ranks after one failed, whose requeue would fail
    again and again; a Slurm preemption requeues by itself, and the time limit's warning is `--signal=USR1@N`. For
    that reason, where there are other ranks, a SIGTERM's line claims no preemption: a rank that failed said what
    matters."""
    cause = signal_name
    if signal_name == "SIGTERM" and env.world_size > 1:
        cause = "SIGTERM (a preemption, or the launcher's stop after another rank failed)"
    console.info(f"{cause}: stopped before training began: nothing trained, no checkpoint written; "
                 f"exiting with code {PREEMPTED_EXIT}")
    if signal_name != "SIGTERM":
        requeue_if_asked(config, env, console)
    elif config.requeue_on_preempt and env.is_main:
        console.info("not requeued: at start-up a SIGTERM may be the launcher's, after another rank failed")
    return Preempted(PREEMPTED_EXIT)


def peer_stopped_first(error: BaseException, preempt: preemption.PreemptionFlag) -> bool:
    """A start-up (up to the end of the first step, which every rank passes together) that failed on a vanished peer
    (the rendezvous, a collective) on a rank that was sent a preemption signal too, which it took only once the wait
    in C++ returned, or after its own first step: the peer's stop, met first, is this rank's too."""
    return (preempt.received is not None and not preempt.stepped and not preempt.interrupted
            and (isinstance(error, RendezvousError) or distributed.peer_left(error)))


def scored(row: dict[str, Any]) -> tuple[float, bool]:
    """An epoch's top-1, and whether the EMA weights scored it (they do when they beat the raw ones)."""
    ema = row.get("val_top1_ema", -1.0) > row["val_top1"]
    return (row["val_top1_ema"] if ema else row["val_top1"]), ema


def best_epoch(history: list[dict[str, Any]]) -> Optional[tuple[dict[str, Any], bool]]:
    """The row of the epoch best.pt holds (the first best), and whether its EMA weights scored it (as `fit` does)."""
    if not history:
        return None
    row = max(history, key=lambda r: scored(r)[0])
    return row, scored(row)[1]


def build(run: Run, stack: contextlib.ExitStack, splits: Optional[tuple[Source, Source]] = None) -> Trainer:
    """Everything a run needs; `splits`: the train and val sources where the caller holds them, else DATA's."""
    began = time.time()
    config, env, console, preempt = run.config, run.env, run.console, run.preempt
    inputs, snapshot = check_inputs(run, stack, splits)
    training = prepare_training(run, inputs, snapshot)
    loaders = build_loaders(run, inputs, training, stack)
    checked = join_job(run, inputs, snapshot, stack)
    share_checkpoint(env, inputs, training, snapshot)
    del snapshot  # its tensors are in the model and optimizer now
    state = training.state
    preempt.steps_done = state.step
    compilation = prepare_compile(run, inputs, training)
    ctx = step_context(run, inputs, training, compilation)
    training = replace(training, micro=fit_micro_batches(run, inputs, training, ctx))
    checkpointer = Checkpointer(inputs.checkpoints, config, inputs.device, env.is_main)
    sample_log = samplelog.SampleLog(os.environ.get(samplelog.ENV_VAR), env.rank, env.world_size)
    cost = (RestartCost(training.resumed_at, process_started_at(), began, time.time(), inputs.load_seconds)
            if training.resumed_at is not None else None)
    sinks = Sinks(inputs.sinks, config.checkpoints_path, console.warn)
    trainer = Trainer(run, training, loaders, ctx, checkpointer, Reports(sinks, sample_log, compilation, cost))
    stack.callback(trainer.close)  # first out: DDP and tensors go before the process group does
    facts = startup_table.describe(console, config, env, inputs, training, loaders, checked, compilation,
                                     ctx.distillation)
    distributed.rank_0_does(lambda: sinks.start(
        state.step, state.history, training.tracker_runs, continuing=config.resume is not None or env.restart_count > 0,
        started_from=training.resumed_at, name=os.path.basename(os.path.abspath(config.checkpoints_path)),
        settings=config.to_dict(), facts=dict(facts)))
    return trainer


def run(config: Config, env: DistEnv) -> None:
    console = Console(env.is_main, env.rank)
    # first: a signal during start-up is not lost; Ctrl-C too (see preemption.py)
    preempt = preemption.PreemptionFlag(config.preempt_signals, interrupts=True, speaks=env.is_main)
    try:
        with contextlib.ExitStack() as stack:
            # Last out: the rank ends with its own exit code (0, 2, 74, 75 or a crash's); a signal now (torchrun's
            # second, a spawn parent stopping the ranks after another failed) would only make it -15 and hide why.
            stack.callback(preempt.ignore_from_now)
            with preempt.starting():  # a preemption signal stops at once: nothing to checkpoint yet
                trainer = build(Run(config, env, console, preempt), stack)
            trainer.fit()
    except preemption.StoppedAtOnce as stop:  # the cleanups ran: the stop's line comes last
        raise stopped_at_once(config, env, console, stop.signal_name) from None
    except (UserError, RuntimeError) as error:
        if peer_stopped_first(error, preempt):
            raise stopped_at_once(config, env, console, str(preempt.received)) from None
        if isinstance(error, UserError):
            # a stop that came while the rank unwound (its launcher's, once rank 0 reported) is not lost to the
            # SIG_IGN the unwinding ends with: the report then stays rank 0's (processes.leave_the_report_to_rank_0)
            error.stopped_by = preempt.received
        raise
    except KeyboardInterrupt:
        if not preempt.training_began:  # once it began, the trainer said what was kept (or the stop's line did)
            console.info("Ctrl-C: stopped before training began: nothing trained, no checkpoint written")
        raise

"""A run's parts, built by trainer.py's `build` in a fixed order of named steps. The order is the point: input errors
fail in the first step, before any worker or process group exists; loader workers fork before the process group's
threads exist; ranks compare their inputs (consistency.py) and receive rank 0's checkpoint only once they can talk. A
step that takes something registers its release on the run's ExitStack: a later failure, or the end, releases it."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from imagenet_elastic.checkpoint import share, store
from imagenet_elastic.config import Config, yaml_file
from imagenet_elastic.data import pipeline, sources
from imagenet_elastic.data.decoding import Decoding, Feed
from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.sampler import BatchPlan, TrainBatchSampler, resolve_global_batch
from imagenet_elastic.data.sources import fingerprints
from imagenet_elastic.errors import UserError
from imagenet_elastic.launch import distributed, preemption
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.models import compile_cache, teacher_weights
from imagenet_elastic.models.compile import Compilation, compile_choice
from imagenet_elastic.models.create import (
    check_model_name,
    create_ema,
    create_model,
    input_options,
    run_sizes,
    saved_sizes,
    untrained_tag,
)
from imagenet_elastic.models.device import Precision, place_model, resolve_precision, use_fastest_kernels
from imagenet_elastic.models.weights import InitialWeights, Weights, describe_published, fetch_published
from imagenet_elastic.optim.optimizer import check_layer_decay, create_optimizer
from imagenet_elastic.optim.schedule import LRSchedule, scaled_lr
from imagenet_elastic.report import metrics, samplelog, sinks
from imagenet_elastic.report.console import Console
from imagenet_elastic.train import consistency, memory_probe, micro_batch, mixing
from imagenet_elastic.train.distillation import LOGIT, Distillation, Teacher, has_distillation_head, loss_weights
from imagenet_elastic.train.state import TrainState, apply_checkpoint, check_compatible, check_resumable
from imagenet_elastic.train.step import StepContext, TrainLoss


@dataclass(frozen=True)
class Run:
    """What a run is given, which its start-up and its loop read throughout."""

    config: Config
    env: DistEnv
    console: Console
    preempt: preemption.PreemptionFlag


@dataclass(frozen=True)
class Training:
    """The training state, new or as the checkpoint left it, and the schedule that follows from it."""

    state: TrainState
    plan: BatchPlan
    sampler: TrainBatchSampler
    precision: Precision
    schedule: LRSchedule
    start: str  # where a fresh run's weights came from: the seed, --initial-checkpoint or --pretrained
    classes: tuple[str, ...]
    resume_from: Optional[str]  # the checkpoint the run started from; None: from scratch
    resumed_at: Optional[float]  # the checkpoint's time stamp
    run_id: str  # the run's identity, kept by every checkpoint it writes and by runs resumed from them
    tracker_runs: dict[str, str]  # the experiment trackers' runs the checkpoint continues (report/sinks/tracker.py)
    saved_micro_batch: Optional[dict[str, Any]] = None  # --micro-batch auto's choice the checkpoint kept
    saved_decoding: Optional[dict[str, str]] = None  # how the checkpoint's run decoded (decoding.Decoding.saved)
    micro: Optional[micro_batch.MicroBatches] = None  # the steps' micro-batches, set on a copy (fit_micro_batches)
    teacher: Optional[teacher_weights.TeacherWeights] = None  # --teacher's; its identity goes in checkpoints
    data: Optional[dict[str, Any]] = None  # rank 0's fingerprint of each split, kept in checkpoints (fingerprints.py)


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    feed: Feed  # where batches are decoded and why there, the workers, and what finishes each batch on the device


LOCK_WAIT_S = 60.0  # how long rank 0 waits for a checkpoints folder held by another (dying) run


@dataclass(frozen=True)
class Inputs:
    """What the run works on, every part checked: where it computes, its data, its checkpoints folder."""

    device: torch.device
    threads: int
    train: sources.Source  # the training split's samples
    val: sources.Source
    checkpoints: store.CheckpointFolder
    resume_from: Optional[str]  # the checkpoint the run starts from; None: from scratch
    from_main: bool  # this rank only mapped the checkpoint: its state comes from rank 0 (share_checkpoint)
    load_seconds: float
    initial_state: Optional[InitialWeights]  # --initial-checkpoint's, for a run that starts fresh
    published: Optional[Weights]  # --pretrained's weights, for a run that starts fresh
    teacher: Optional[teacher_weights.TeacherWeights]  # --teacher's model, frozen, on the CPU (a training run's only)
    sinks: tuple[sinks.Sink, ...]  # rank 0's: steps.jsonl, TensorBoard, the trackers (--wandb, ...), checked
    data: Optional[dict[str, Any]] = None  # rank 0's fingerprint of each split, for checkpoints (check_data)
    forked: bool = False  # rank 0: continues a checkpoint from elsewhere in a new folder, as a run of its own


def check_inputs(run: Run, stack: contextlib.ExitStack, splits: Optional[tuple[sources.Source, sources.Source]] = None
                 ) -> tuple[Inputs, Optional[dict[str, Any]]]:
    """Every check that can fail on the user's input: data, checkpoints folder (locked by rank 0), the checkpoint to
    resume from (loaded, returned beside the inputs). `splits`: the caller's sources, else DATA's."""
    config, env, console = run.config, run.env, run.console
    samplelog.check_folder(os.environ.get(samplelog.ENV_VAR))
    threads = distributed.configure_threads(config.threads, env.local_world_size)
    device = distributed.select_device(config.device, env)
    use_fastest_kernels(device)
    check_model_name(config.model)  # a typo costs no scan of the data and leaves no checkpoints folder
    # --pretrained's weights: now if surely a fresh start (a missing file costs no data scan), else once resume is known
    weights = fetch_published(config.model) if config.pretrained and not config.resume else None
    check_model_options(config)
    input_options(config.model, run_sizes(config))  # a model of one input size that cannot take the run's says so
    # --teacher's weights are read now (a missing file or name costs no scan of the data), their hash taken once
    teacher = teacher_weights.read(config.teacher) if config.teacher else None
    if splits is None:
        splits = sources.open_splits(config.data, config.val_path, config.val_labels, config.checkpoints_path)
    else:
        sources.check_same_classes(*splits)
    train, val = splits
    if teacher is not None:
        teacher_weights.check_classes(teacher, train.classes)
    for note in (*train.notes, *val.notes):
        console.warn(note)
    if config.requeue_on_preempt and preemption.slurm_job_to_requeue(os.environ) is None:
        raise UserError("--requeue-on-preempt needs a Slurm job, but SLURM_JOB_ID is not set")
    checkpoints = store.CheckpointFolder(config.checkpoints_path, config.keep_checkpoints, console.warn)
    store.check_writable(config.checkpoints_path, (yaml_file.FILE_NAME, metrics.FILENAME))  # written after a save
    if env.is_main:
        lock, wait = store.CheckpointLock(config.checkpoints_path), min(LOCK_WAIT_S, config.dist_timeout)
        lock.acquire(wait, lambda holder: console.warn(
            f"{config.checkpoints_path} is locked by {holder}; waiting up to {wait:g} s"))
        stack.callback(lock.release)
    chosen = sinks.chosen(config, env.is_main)
    resume_from = checkpoints.resume_path(config.resume, restarted=env.restart_count > 0)
    start = time.perf_counter()
    # load once (checkpoint/share.py): the other ranks map it, and receive its tensors in share_checkpoint
    from_main = env.launched and not env.is_main and resume_from is not None
    snapshot = store.load(resume_from, lazy=from_main) if resume_from else None
    forked = False
    if snapshot is not None:
        check_compatible(snapshot, resume_from, config.model, train.classes, config.opt, config.blurpool)
        check_resumable(snapshot, resume_from)
        # rank 0's folder, as its lock is; a fork (a checkpoint from elsewhere into a new folder) is a run of its own
        forked = env.is_main and not checkpoints.check_same_run(resume_from, snapshot.get("run_id"))
        if env.is_main and not forked:
            checkpoints.check_best()
        warn_differences(console, [teacher_weights.compare(snapshot.get("teacher"), teacher, resume_from)])
    data = check_data(run, train, val, snapshot)
    initial = InitialWeights.read(config.initial_checkpoint) if config.initial_checkpoint and snapshot is None else None
    if config.pretrained and weights is None and snapshot is None:
        weights = fetch_published(config.model)  # a bare --resume that found no checkpoint: a fresh start
    return Inputs(device, threads, train, val, checkpoints, resume_from, from_main, time.perf_counter() - start,
                  initial, weights, teacher, tuple(chosen), data, forked), snapshot


def check_model_options(c: Config) -> None:
    """Options asking for what a model may lack (--drop-path, --blurpool, --layer-decay, --grad-checkpointing,
    --kd-token-distill-type hard), tried on a meta-device copy built as the run's, before the data scan."""
    head = bool(c.teacher) and c.kd_token_distill_type != "soft"
    if not (c.drop_path or c.blurpool or c.layer_decay is not None or c.grad_checkpointing or head):
        return
    with torch.device("meta"):
        model = create_model(c.model, 1, c.drop_path, c.blurpool, grad_checkpointing=c.grad_checkpointing)
    if c.layer_decay is not None:
        check_layer_decay(model, c.model)
    if head and not has_distillation_head(model):
        raise UserError(f"--kd-token-distill-type hard: timm's {c.model} has no distillation head (DeiT's "
                        "`*_distilled_*` models have one); a student without one learns the teacher's logits (KL)")


def check_one_image_micro_batches(c: Config, classes: int, plan: BatchPlan, sizes: tuple[tuple[int, str], ...]) -> None:
    """A micro-batch of one image leaves a batch norm after global pooling one value per channel, which torch refuses
    at the first step: tried on a meta-device copy at the smallest training size, it is one line before training."""
    with torch.device("meta"):
        model = create_model(c.model, classes, c.drop_path, c.blurpool, sizes=sizes)
        try:
            side = min(size for size, flag in sizes if flag in ("--image-size", "--progressive-resize"))
            model.train()(torch.empty(1, 3, side, side))
        except ValueError as error:
            if "more than 1 value per channel" in str(error):
                raise UserError(f"the global batch {plan.describe()} has micro-batches of 1 image, on which "
                                f"{c.model}'s batch norm cannot train: choose a --global-batch-size, --batch-size or "
                                "number of processes that gives every micro-batch 2 images or more") from None
        except (RuntimeError, NotImplementedError, AssertionError):
            pass  # a forward the meta device cannot run tells nothing: the first step will


def check_data(run: Run, train: sources.Source, val: sources.Source, snapshot: Optional[dict[str, Any]]
               ) -> Optional[dict[str, Any]]:
    """Rank 0: warns of each split differing from the checkpoint's run's; returns their fingerprints for checkpoints."""
    if not run.env.is_main:
        return None
    saved = (snapshot or {}).get("data") or {}
    splits = {"train": train, "val": val}
    taken = {role: fingerprints.fingerprint(source) for role, source in splits.items()}  # its cost: docs/BENCHMARKS.md
    warn_differences(run.console, [fingerprints.difference(saved.get(role), source, taken[role])
                                   for role, source in splits.items()])
    return {role: taken[role].saved() for role in taken}


def prepare_training(run: Run, inputs: Inputs, snapshot: Optional[dict[str, Any]]) -> Training:
    """Model, optimizer and GradScaler from the seed, then the checkpoint's state; the global batch and LR schedule."""
    config, env, console = run.config, run.env, run.console
    saved = snapshot or {}
    saved_batch = saved.get("global_batch")
    plan = BatchPlan(resolve_global_batch(config.global_batch_size, saved_batch, config.batch_size, env.world_size),
                     env.world_size, config.batch_size)
    sampler = TrainBatchSampler(len(inputs.train), plan, env.rank, config.seed, config.max_steps_per_epoch,
                                config.ra_reps)
    torch.manual_seed(config.seed)
    precision = resolve_precision(config.amp, inputs.device)
    if precision.warning:
        console.warn(precision.warning)
    if config.mixes:
        mixing.check_pairs(plan)
    classes = len(inputs.train.classes)
    built_for = saved_sizes(snapshot.get("config", {}))[0][0] if snapshot is not None else None  # its weights' size
    sizes = run_sizes(config, built_for)
    if min(part.stop - part.start for part in plan.all_micro_slices()) == 1:
        check_one_image_micro_batches(config, classes, plan, sizes)
    model = place_model(create_model(config.model, classes, config.drop_path, config.blurpool, inputs.published,
                                     config.grad_checkpointing, sizes), inputs.device, config.channels_last)
    if inputs.teacher is not None and has_distillation_head(model):
        model.set_distilled_training(True)  # training's forward gives both heads' logits; eval's still their average
    if inputs.published is not None:
        start = describe_published(inputs.published, classes)
    elif inputs.initial_state is not None:
        start = inputs.initial_state.load(model, config.initial_checkpoint, config.model, inputs.train.classes)
    else:
        start = "random (seed)"
        if snapshot is None and (warning := untrained_tag(config.model)) is not None:  # a fresh start
            console.warn(warning)
    if inputs.initial_state is not None and inputs.initial_state.blurpool not in (None, config.blurpool):
        mismatch = ("with --blurpool and this run has no blur" if inputs.initial_state.blurpool else
                    "without --blurpool and this run blurs")
        console.warn(f"--initial-checkpoint {config.initial_checkpoint} was trained {mismatch}: its weights now "
                     "see inputs they were not trained on")
    schedule = LRSchedule(scaled_lr(config.lr, plan.global_batch), round(config.warmup_epochs * sampler.steps),
                          sampler.steps * config.epochs, config.lr_min, config.sched,
                          max(1, round(config.decay_epochs * sampler.steps)), config.decay_rate)
    optimizer = create_optimizer(model, schedule.peak, config.momentum, config.weight_decay, inputs.device,
                                 config.opt, layer_decay=config.layer_decay)
    scaler = torch.amp.GradScaler(inputs.device.type, enabled=precision.dtype == torch.float16)
    ema = create_ema(model, config.model_ema_decay, config.model_ema_warmup) if config.model_ema else None
    state = TrainState(model, optimizer, scaler, ema=ema)
    if snapshot is not None:
        if not inputs.from_main:
            apply_checkpoint(state, snapshot, inputs.resume_from)
        changes = config.differences(snapshot.get("config", {}))
        if saved_batch not in (None, plan.global_batch):
            changes.append(f"global batch: checkpoint {saved_batch}, now {plan.global_batch}")
        saved_world = snapshot.get("world_size")
        if saved_world not in (None, env.world_size) and saved_batch == plan.global_batch:
            before = BatchPlan(plan.global_batch, saved_world, config.batch_size)
            if before.all_micro_slices() != plan.all_micro_slices():
                changes.append(f"micro-batches: checkpoint {before.describe()}, now {plan.describe()} (batch-norm "
                               "statistics, dropout and drop path are computed per micro-batch)")
        warn_differences(console, changes)
    run_id = (None if inputs.forked else saved.get("run_id")) or secrets.token_hex(8)  # new for a fresh run or fork
    return Training(state, plan, sampler, precision, schedule, start, inputs.train.classes, inputs.resume_from,
                    saved.get("saved_at"), run_id, {} if inputs.forked else dict(saved.get("trackers") or {}),
                    saved.get("micro_batch"), saved.get("decoding"), teacher=inputs.teacher, data=inputs.data)


def build_loaders(run: Run, inputs: Inputs, training: Training, stack: contextlib.ExitStack) -> Loaders:
    """Train and val loaders, their workers forked now, while this process has one thread (pipeline.start_workers)."""
    config, env, console = run.config, run.env, run.console
    cores = distributed.available_cores()
    decoding = Decoding.choose(config.decode, inputs.device, cores // max(1, env.local_world_size), config.augment,
                               config.gpu_decoder)
    if decoding.warning(inputs.device):
        console.warn(decoding.warning(inputs.device))
    warn_differences(console, [decoding.change_from(training.saved_decoding)])
    largest = max(config.train_sizes.largest, config.eval_crop)  # progressive resizing ends at its largest
    feed = decoding.feed(inputs.device, config.workers, cores, env.local_world_size, config.batch_size, largest,
                         functools.partial(console.warn, every_rank=True))
    ignored = preemption.worker_ignored(config.preempt_signals)  # by loader workers: see pipeline._worker_init
    train = feed.train_loader(inputs.train, config.train_sizes, config.seed, config.augment, training.sampler, ignored)
    val = feed.eval_loader(inputs.val, config.eval_crop, config.eval_resize, config.batch_size, env.rank,
                           env.world_size, ignored)
    start_loader_workers([train, val], stack)
    return Loaders(train, val, feed)


def warn_differences(console: Console, changes: list[Optional[str]]) -> None:
    """One warning for each way a resumed run differs from its checkpoint's run (None: no difference)."""
    for change in filter(None, changes):
        console.warn(f"resumed run differs from its checkpoint, results will not match exactly: {change}")


def start_loader_workers(loaders: list[DataLoader], stack: contextlib.ExitStack) -> None:
    """Fork the loaders' workers while this process has one thread, after freezing what they share; `evaluate` too."""
    pipeline.share_heap_with_workers()
    stack.callback(pipeline.stop_loader_workers)
    for loader in loaders:
        pipeline.start_workers(loader)


def join_process_group(env: DistEnv, device: torch.device, timeout: float, stack: contextlib.ExitStack) -> None:
    """The process group, after the loader workers forked (start_loader_workers); the rank's end destroys it."""
    distributed.init_process_group(env, device, timeout)
    stack.callback(distributed.destroy_process_group)
    # out before the group goes: the workers' frozen heap (DDP's objects too) must be collectable then (see there)
    stack.callback(pipeline.thaw_heap)


def join_job(run: Run, inputs: Inputs, snapshot: Optional[dict[str, Any]], stack: contextlib.ExitStack
             ) -> Optional[float]:
    """The process group, then the check that every rank has the same data, settings, code, checkpoints folder and
    checkpoint (returns its seconds); rank 0 then keeps the checked sources' lists for the next start."""
    config, env, console = run.config, run.env, run.console
    join_process_group(env, inputs.device, config.dist_timeout, stack)
    checked = None
    if env.launched:
        start = time.perf_counter()
        token = store.read_lock_token(config.checkpoints_path)
        consistency.check_same_job(config, inputs.train, inputs.val, token, snapshot,
                                   inputs.teacher.sha256 if inputs.teacher is not None else None)
        checked = time.perf_counter() - start
    if env.is_main:
        for source in (inputs.train, inputs.val):
            try:
                source.keep(config.checkpoints_path)
            except OSError as error:  # only a cache: the next start scans again
                console.warn(f"could not keep the {source.role} list in {config.checkpoints_path}: "
                             f"{error.strerror or error}")
    return checked


def share_checkpoint(env: DistEnv, inputs: Inputs, training: Training, snapshot: Optional[dict[str, Any]]) -> None:
    """Rank 0's checkpoint reaches the other ranks over the process group (see checkpoint/share.py)."""
    if env.launched and inputs.resume_from is not None:
        received = share.from_main(snapshot if env.is_main else None, inputs.device)
        if inputs.from_main:
            training.state.apply(received)


def prepare_compile(run: Run, inputs: Inputs, training: Training) -> Compilation:
    """Whether the step compiles; every rank loads the compile caches beside the checkpoints first."""
    config, env, console, device = run.config, run.env, run.console, inputs.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    enabled, reason = compile_choice(config.compile, device.type, capability)
    cache = None
    if enabled:
        key = compile_cache.cache_key(device, model=config.model, classes=len(inputs.train.classes),
                                      precision=training.precision.name, channels_last=config.channels_last,
                                      blurpool=config.blurpool, drop_path=config.drop_path,
                                      grad_checkpointing=config.grad_checkpointing)
        cache = compile_cache.CompileCache(config.checkpoints_path, key, console.warn)
        cache.load()
    return Compilation(enabled, reason, config.model, cache, console.warn, env.is_main)


def step_context(run: Run, inputs: Inputs, training: Training, compilation: Compilation) -> StepContext:
    """What a step needs beside its batch: --teacher's token distillation where the student has a distillation head,
    else logit distillation; the model compiled (else eager), then DDP-wrapped. Checkpoints save the unwrapped one
    (shared parameters, no `_orig_mod.` prefix), so eager and compiled runs resume each other."""
    config, state, device = run.config, training.state, inputs.device
    student = ModelInput(device, training.precision.dtype, config.channels_last)
    distillation = None
    if training.teacher is not None:
        kind = config.kd_token_distill_type if has_distillation_head(state.model) else LOGIT
        distillation = Distillation(Teacher(training.teacher, student), kind, config.kd_temperature,
                                    *loss_weights(config.task_loss_weight, config.distill_loss_weight))
    model = compilation.wrap(state.model)
    if run.env.launched:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mixer = mixing.Mixer(config.mixup_alpha, config.cutmix_alpha, len(training.classes)) if config.mixes else None
    return StepContext(model, state.optimizer, state.scaler,
                       TrainLoss(config.label_smoothing, config.bce_loss, config.bce_target_thresh), student, mixer,
                       config.clip_grad_norm, config.grad_checkpointing, distillation)


def fit_micro_batches(run: Run, inputs: Inputs, training: Training, ctx: StepContext) -> micro_batch.MicroBatches:
    """--batch-size's micro-batches, or under --micro-batch auto the largest that fits this GPU (the checkpoint's
    choice for it, else probed: memory_probe.py), after DDP's buckets and the EMA copy took their memory."""
    config, env, console = run.config, run.env, run.console
    state, size = training.state, config.train_sizes.largest

    def probe(first: int, smaller: Any) -> int:
        found = memory_probe.probe(state.model, state.optimizer, ctx.criterion, ctx.input, size, first, smaller,
                                   ctx.distillation)
        if found is None:
            raise UserError(f"--micro-batch auto: no micro-batch of {size} px images, however small, fits a training "
                            f"step of {config.model} on {inputs.device}")
        return found

    settings = {"model": config.model, "blurpool": config.blurpool, "batch_size": config.batch_size,
                "image_size": size, "precision": training.precision.name, "channels_last": config.channels_last,
                "grad_checkpointing": config.grad_checkpointing, "opt": config.opt, "model_ema": config.model_ema,
                "ddp": env.launched, **({"teacher": training.teacher.sha256} if training.teacher is not None else {})}
    return micro_batch.choose(config.micro_batch == micro_batch.AUTO, training.plan, env.rank, config.mixes,
                              inputs.device, settings, training.saved_micro_batch, probe,
                              functools.partial(console.warn, every_rank=True))

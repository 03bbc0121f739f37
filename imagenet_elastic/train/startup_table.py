"""The start-up table rank 0 prints once a run is built: what was built, and the choices made for
this machine (precision, loader workers, the recipe's options)."""

from __future__ import annotations

from typing import Any, Optional

from imagenet_elastic.config import Config
from imagenet_elastic.data.decoding import Feed
from imagenet_elastic.data.pipeline import PINNED_BUDGET
from imagenet_elastic.errors import INTERRUPTED_EXIT, PREEMPTED_EXIT
from imagenet_elastic.launch.distributed import group_options
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.models.blurpool import blurred
from imagenet_elastic.models.compile import Compilation
from imagenet_elastic.models.create import count_parameters
from imagenet_elastic.models.teacher_weights import TeacherWeights
from imagenet_elastic.report.console import Console
from imagenet_elastic.train.build import Inputs, Loaders, Training
from imagenet_elastic.train.distillation import Distillation


def describe(console: Console, c: Config, env: DistEnv, inputs: Inputs, training: Training,
             loaders: Loaders, checked_s: Optional[float], compilation: Compilation,
             distillation: Optional[Distillation] = None) -> list[tuple[str, str]]:
    """Prints the start-up table and returns its rows (trackers record them); `checked_s`: the rank check's seconds
    (None: one process)."""
    plan = training.plan
    interval = [f"every {c.checkpoint_every_steps} steps"] if c.checkpoint_every_steps else []
    interval += [f"every {c.checkpoint_every_seconds:g} s"] if c.checkpoint_every_seconds else []
    rows = [
        ("model", f"{c.model} ({count_parameters(training.state.model) / 1e6:.2f} M parameters)"
                  + (f", BlurPool before {blurred(training.state.model)} strided convolutions" if c.blurpool else "")),
        ("classes", str(len(inputs.train.classes))),
        ("train images", inputs.train.describe()),
        ("val images", inputs.val.describe()),
        ("world size", f"{env.world_size} ({env.local_world_size} per node), device {inputs.device}"),
        ("launcher", f"{env.launcher}, {group_options(inputs.device)['backend']}, rendezvous {env.master_addr}:"
                     f"{env.master_port}; every rank has the same data, settings, code and checkpoints folder "
                     f"(checked in {checked_s:.2f} s)" if checked_s is not None else "none (single process)"),
        ("global batch", training.micro.plan.describe()),
        ("micro-batch", training.micro.describe()),
        ("initial weights", training.start if not training.resume_from else f"from {training.resume_from}"),
        ("model EMA", f"decay {c.model_ema_decay:g} "
                      + ("per step" if c.model_ema_steps == 1 else f"every {c.model_ema_steps} steps")
                      + (" after timm's warmup" if c.model_ema_warmup else "")
         if training.state.ema is not None else "off"),
        ("optimizer", describe_optimizer(c, training.state.optimizer)),
        ("loss", ("binary cross-entropy" + (f", targets > {c.bce_target_thresh:g} -> 1" if c.bce_target_thresh
                                            is not None else "") if c.bce_loss else "cross-entropy")
         + f", label smoothing {c.label_smoothing:g}" + (f", drop path {c.drop_path:g}" if c.drop_path else "")),
        ("teacher", describe_teacher(c, training.teacher, distillation)),
        ("image size", f"train {c.train_sizes.describe(c.epochs)}; val {c.eval_crop} px after a resize to "
                       f"{c.eval_resize}" + (", logits averaged with the mirror image's" if c.val_flip_average
                                             else "")),
        ("augmentation", c.augment.describe()),
        ("mixing", describe_mixing(c)),
        ("repeated augmentation", f"{c.ra_reps} copies of {plan.global_batch // c.ra_reps} images per global batch"
         if c.ra_reps > 1 else "off"),
        ("learning rate", f"{training.schedule.peak:.6g} = {c.lr:g} x {plan.global_batch}/256, "
                          f"{training.schedule.describe()}"),
        ("steps per epoch", str(training.sampler.steps)),
        ("precision", training.precision.describe()),
        ("channels_last / compile", f"{c.channels_last} / {compilation.describe()}"
                                    + ("; activations recomputed in the backward pass (--grad-checkpointing)"
                                       if c.grad_checkpointing else "")),
        ("decode", loaders.feed.decoding.describe(inputs.device, c.augment)),
        ("threads / loader workers", describe_loader_workers(inputs.threads, loaders.feed)),
        ("checkpoints", f"{c.checkpoints_path} (each epoch{''.join(', ' + i for i in interval)}; "
                        f"{'background' if c.async_checkpoint else 'synchronous'} writes)"),
        ("curves", f"every {c.log_interval} steps: {'; '.join(sink.name for sink in inputs.sinks)}" if inputs.sinks
         else "none"),
        ("preemption", f"{', '.join(c.preempt_signals) or 'no signals'}: checkpoint and exit {PREEMPTED_EXIT}"
                       + (", then requeue the Slurm job" if c.requeue_on_preempt else "")
                       + ("" if "SIGINT" in c.preempt_signals else f"; Ctrl-C: checkpoint and exit {INTERRUPTED_EXIT} "
                          "(twice: at once)")),
    ]
    console.table("imagenet_elastic", rows)
    return rows


def describe_teacher(c: Config, teacher: Optional[TeacherWeights], distillation: Optional[Distillation]) -> str:
    """What the student distils from (--teacher): the weights and their hash, the input the teacher gets, the loss."""
    if teacher is None or distillation is None:
        return "off"
    changed = (["renormalised"] if distillation.teacher.scale is not None else []) + \
              (["resized on the device"] if c.progressive_resize or teacher.input.size != (c.image_size,) * 2 else [])
    seen = f"the student's batch {' and '.join(changed)}" if changed else "the student's batch as it is"
    return (f"{teacher.spec}: {teacher.source}, {count_parameters(teacher.model) / 1e6:.2f} M parameters, sha256 "
            f"{teacher.sha256[:12]}; input {teacher.input.describe()} ({seen}); frozen, eval mode; "
            f"{distillation.describe()}")


def describe_loader_workers(threads: int, feed: Feed) -> str:
    """`8 / 14 per process, 2 batches ahead each (pinned budget 1 GiB)`: how far ahead the workers prepare, and on
    CUDA the page-locked memory that bounds it (pipeline.prefetch_factor)."""
    text = f"{threads} / {feed.workers} per process"
    if feed.workers:
        text += f", {feed.prefetch} batches ahead each"
        if feed.pinned:
            text += f" (pinned budget {PINNED_BUDGET / 2**30:g} GiB)"
    return text


def describe_optimizer(c: Config, optimizer: Any) -> str:
    """The parameters its groups leave undecayed (1-D ones, and by name the others), --layer-decay's LR scales."""
    groups = optimizer.param_groups
    named = [name for group in groups if not group["weight_decay"]
             for name, param in zip(group.get("param_names", ()), group["params"]) if param.ndim > 1]
    text = f"{c.opt}, weight decay {c.weight_decay:g} (none on 1-D parameters: norms, biases" + (
        f"; nor on {', '.join(named)} (no_weight_decay))" if named else ")")
    if c.layer_decay is not None:
        scales = sorted({group.get("lr_scale", 1.0) for group in groups})
        text += f", layer decay {c.layer_decay:g}: {len(scales)} layers, LR x{scales[0]:.3g} to x{scales[-1]:.3g}"
    return text + (f", gradient norm clipped to {c.clip_grad_norm:g}" if c.clip_grad_norm else "")


def describe_mixing(c: Config) -> str:
    kinds = [f"{name} alpha {alpha:g}" for name, alpha in (("mixup", c.mixup_alpha), ("cutmix", c.cutmix_alpha))
             if alpha > 0]
    return " or ".join(kinds) + " per pair of the global batch" + (", half each" if len(kinds) == 2 else "") \
        if kinds else "off"

"""The run's settings: built once from the command line, frozen, and saved in every checkpoint. Each field says
everything about its setting; the command line and docs/OPTIONS.md's option table are built from them."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from imagenet_elastic import options
from imagenet_elastic.data.augment import AugmentSettings, check_range
from imagenet_elastic.data.decoding import DecodeSettings
from imagenet_elastic.data.resolution import ResolutionSettings, TrainSizes
from imagenet_elastic.data.sources import SourceSettings
from imagenet_elastic.errors import UserError
from imagenet_elastic.launch.launchers import LaunchSettings
from imagenet_elastic.launch.preemption import PreemptionSettings
from imagenet_elastic.optim.optimizer import OptimizerSettings
from imagenet_elastic.optim.schedule import ScheduleSettings
from imagenet_elastic.options import option
from imagenet_elastic.report.sinks import ReportSettings

RESUME_AUTO = "auto"  # `--resume` without a path: CHECKPOINTS/last.pt when it exists, else a fresh start
LAST_FILE = "last.pt"  # the newest checkpoint of a folder: what a bare `--resume` and `--resume FOLDER` take
# timm's model-name prefixes that say where the weights are, not what the model is
WEIGHT_SOURCES = ("hf-hub:", "local-dir:")

# Those whose change makes --evaluate's scores differ from the run's own validation (the others are training's).
VALIDATION_SENSITIVE = ("image_size", "val_crop_size", "val_resize", "amp")


def no_checkpoint(resume: str) -> str:
    """Why `--resume PATH` names no checkpoint, in the words its refusals use."""
    return f"a folder without {LAST_FILE}" if os.path.isdir(resume) else "no such checkpoint file or folder"


@dataclass(frozen=True)
class Config(ReportSettings, PreemptionSettings, LaunchSettings, DecodeSettings, ScheduleSettings, OptimizerSettings,
             ResolutionSettings, AugmentSettings, SourceSettings):
    """Every setting of a run. Each folder declares its own settings beside what they choose from; they are
    gathered here, the last base's first (DATA leads). Those whose folders import config/ are declared here."""

    model: str = option("resnet50", "any timm model name, randomly initialised unless --pretrained (a pretrained "
                        "tag too, with a warning); with --pretrained also a pretrained tag (`resnet50.a1_in1k`) or "
                        "`hf-hub:ORG/NAME` or `local-dir:FOLDER`", "model", "NAME")
    pretrained: bool = option(
        False, "start a fresh run from the weights timm publishes for --model (its tag, else timm's default one), "
        "read through the Hugging Face hub cache (HF_HOME; HF_HUB_OFFLINE=1: the cache alone); a classifier of "
        "another class count is re-initialised. A resumed run continues from its own checkpoint instead", "model",
        action=argparse.BooleanOptionalAction)
    initial_checkpoint: Optional[str] = option(
        None, "start a fresh run from these weights (fine-tuning): our checkpoint (a run's checkpoints folder: its "
        "best.pt), an export folder, a timm or torchvision state dict, or a .safetensors file; a classifier of "
        "another class count (or, in our checkpoint or export, of other class names) is re-initialised. A resumed "
        "run continues from its own checkpoint instead", "model", "PATH")
    image_size: int = option(
        224, "train crop size (unless --progressive-resize) and val crop size (unless --val-crop-size)", "model", "N",
        type=options.image_side, exact=True)
    val_crop_size: Optional[int] = option(
        None, "val centre crop size; larger than the train size for FixRes recipes (train 176, val 224)", "model",
        "N", shown_default="image-size", type=options.image_side)
    val_resize: Optional[int] = option(None, "val short side before the centre crop (256 for 224, 232 in "
                                       "torchvision's v2 recipe)", "model", "N",
                                       shown_default="val crop / 0.875", type=options.image_side)
    val_flip_average: bool = option(
        False, "validate on the mean of the logits of each image and of its mirror image (FFCV's lr_tta: its "
        "published results use it); an exported model does not do it", "model", action=argparse.BooleanOptionalAction)
    mixup_alpha: float = option(
        0.0, "mixup: images at positions 2k and 2k+1 of each global batch become weighted averages of the two, with "
        "a weight from Beta(A, A) per pair, and their targets the same mix of the labels (0: off)", "augment", "A",
        type=options.non_negative_float, exact=True)
    cutmix_alpha: float = option(
        0.0, "cutmix: the same pairs swap a box whose area is drawn from Beta(A, A); with --mixup-alpha each pair "
        "takes one of the two at random. Partners and draws depend on (seed, step) only, not on the world size "
        "(each micro-batch must then hold an even number of images)", "augment", "A",
        type=options.non_negative_float, exact=True)
    epochs: int = option(90, "training epochs", "model", "N", type=options.epoch_count, exact=True)
    batch_size: int = option(
        64, "per process and forward pass; a larger per-process share of the global batch is split into "
        "micro-batches of at most N (gradient accumulation)", "model", "N", type=options.batch_count, exact=True)
    micro_batch: Optional[str] = option(
        None, "auto: before the first step, find the largest micro-batch (--batch-size, halved until it fits) that "
        "a training step of this model, precision and image size fits on this GPU, and accumulate up to the "
        "global batch; kept in the checkpoints, so a restart on the same kind of GPU does not search again. A step "
        "or validation that still runs out of memory is redone in halves, once per run for each; on a CPU: "
        "--batch-size's micro-batches", "model", shown_default="--batch-size", choices=["auto"])
    global_batch_size: Optional[int] = option(
        None, "samples per optimizer step over all processes; kept when the world size changes, so the "
        "optimisation does not (docs/LAUNCHING.md, Fault tolerance)", "model", "N",
        shown_default="checkpoint's, else batch-size x processes", type=options.batch_count)
    model_ema: bool = option(
        False, "keep an exponential moving average of the weights (timm's ModelEmaV3), updated every optimizer "
        "step, kept in every checkpoint and validated every epoch beside the raw weights (`val_*_ema` in "
        "metrics.jsonl; best.pt says which of the two was best)", "model", action=argparse.BooleanOptionalAction,
        exact=True)
    model_ema_decay: float = option(0.9998, "EMA decay per update (see --model-ema-steps)", "model", "X",
                                    type=options.probability, exact=True)
    model_ema_steps: int = option(1, "the EMA takes the weights every N optimizer steps (torchvision's "
                                  "--model-ema-steps; its v2 recipe uses 32)", "model", "N", type=options.step_count,
                                  exact=True)
    model_ema_warmup: bool = option(
        False, "EMA decay ramps up as 1 - (1 + step)^(-2/3) to --model-ema-decay (timm's warmup), so a short run's "
        "average is not dominated by its first weights", "model", action=argparse.BooleanOptionalAction, exact=True)
    label_smoothing: float = option(0.1, "training loss only; validation loss is plain cross-entropy", "model", "X",
                                    type=options.probability, exact=True)
    bce_loss: bool = option(
        False, "binary cross-entropy per class (timm's BinaryCrossEntropy, as in its \"ResNet strikes back\" "
        "recipes) instead of softmax cross-entropy", "model", action=argparse.BooleanOptionalAction, exact=True)
    bce_target_thresh: Optional[float] = option(
        None, "with --bce-loss: targets above X become 1, the rest 0 (timm's --bce-target-thresh)", "model", "X",
        type=options.probability, exact=True)
    teacher: Optional[str] = option(
        None, "distil from this model: a timm name with published weights, read as --pretrained reads them "
        "(`resnet50.a1_in1k`, `hf-hub:ORG/NAME`, `local-dir:FOLDER`), one of our checkpoints (its raw weights; a "
        "run's checkpoints folder: its best.pt) or an export folder (`imagenet-elastic export`). It runs frozen, in "
        "eval mode, in the run's precision, on the student's augmented and mixed batch, resized and renormalised to "
        "its own input. Any student learns its logits (KL at --kd-temperature); a student with DeiT's distillation "
        "head (timm's `*_distilled_*`) learns them with that head (--kd-token-distill-type) and validates on the "
        "average of its two heads. Checkpoints keep its identity (a hash of its weights), not its weights: a resume "
        "with another teacher is refused",
        "model", "MODEL")
    kd_temperature: float = option(4.0, "--teacher: the temperature both distributions are softened at before their "
                                   "KL divergence, which is then scaled by T^2 (timm's --kd-temperature)", "model", "T",
                                   type=options.positive_float, exact=True)
    task_loss_weight: Optional[float] = option(
        None, "--teacher: the task loss's weight; given alone, the distillation loss's is 1 - X (timm's weights)",
        "model", "X", shown_default="1", type=options.non_negative_float, exact=True)
    distill_loss_weight: Optional[float] = option(
        None, "--teacher: the distillation loss's weight", "model", "X", shown_default="1, or 1 - task-loss-weight",
        type=options.non_negative_float, exact=True)
    kd_token_distill_type: str = option(
        "soft", "--teacher, for a student with a distillation head: its loss, soft (KL at --kd-temperature, x T^2) "
        "or hard (cross-entropy with the teacher's top class: DeiT's best)", "model", choices=["soft", "hard"],
        exact=True)
    drop_path: float = option(
        0.0, "stochastic depth: the rate timm's model drops residual branches at (its drop_path_rate); drawn per "
        "micro-batch from (seed, step, position in the global batch)", "model", "X", type=options.probability,
        exact=True)
    blurpool: bool = option(
        False, "blur the input of every strided convolution with 16 or more input channels (FFCV's BlurPool, on in "
        "its recipes; timm's BlurPool2d filter). Part of the model: a checkpoint resumes and evaluates only with "
        "the setting it was trained with, and --initial-checkpoint warns when they differ", "model",
        action=argparse.BooleanOptionalAction)
    seed: int = option(0, "model init, data order and augmentation all derive from it", "model", "N",
                       type=options.seed_number, exact=True)
    amp: str = option(
        "auto", "auto: the fastest correct precision for this machine. GPUs: bf16 where native (Ampere and newer), "
        "else fp16 with a GradScaler whose state is checkpointed. CPUs: bf16 only where native (AVX512-BF16 or "
        "AMX), else fp32, because emulated bf16 is far slower (docs/BENCHMARKS.md). The start-up table says what "
        "was chosen and why; an explicit bf16 or fp16 that the device only emulates still runs, with one warning",
        "model", choices=["auto", "bf16", "fp16", "none"], exact=True)
    grad_checkpointing: bool = option(
        False, "recompute each block's activations in the backward pass instead of keeping them (timm's "
        "set_grad_checkpointing): less memory for large models, about a third more compute, the same numbers",
        "model", action=argparse.BooleanOptionalAction)
    channels_last: bool = option(True, "NHWC memory format, on GPUs and CPUs alike (measured on CPU in "
                                 "docs/BENCHMARKS.md)", "model", action=argparse.BooleanOptionalAction)
    compile: Optional[bool] = option(
        None, "`torch.compile` the model before DDP wraps it (unset: on a CUDA device, off on CPUs, where it is "
        "slower); a model that cannot compile trains eager, with one warning. Rank 0 keeps torch's compile caches "
        "in CHECKPOINTS/compile_cache.bin, which every rank of a restart loads before compiling (torch >= 2.7). "
        "Checkpoints hold the original module's weights (no `_orig_mod.` prefix), so compiled and eager runs "
        "resume each other; validation runs eager", "model", shown_default="on CUDA, off on CPU",
        action=argparse.BooleanOptionalAction)
    device: str = option("auto", "`cuda:LOCAL_RANK` when CUDA is visible", "run", choices=["auto", "cpu", "cuda"])
    checkpoints_path: str = option("./checkpoints", "where checkpoints and `metrics.jsonl` go", "checkpoints", "DIR")
    keep_checkpoints: int = option(3, "newest `epoch_NNNN.pt` files kept (0: none, `last.pt`/`best.pt` only)",
                                   "checkpoints", "K", type=options.kept_count)
    async_checkpoint: bool = option(
        True, "write checkpoints in a background thread: training waits only for a copy of the state in host "
        "memory; a stop, the end of the run and errors wait for the write in flight (docs/OUTPUTS.md, Checkpoints)",
        "checkpoints", action=argparse.BooleanOptionalAction)
    resume: Optional[str] = option(
        None, "continue from the checkpoint PATH, or from FOLDER/last.pt where PATH is a run's checkpoints folder "
        "(which then also takes this run's checkpoints, unless --checkpoints-path says otherwise). `--resume PATH` "
        "takes the next word when it is a file, ends in .pt or is a folder holding last.pt; `--resume=PATH` always. "
        "Bare `--resume`: from `DIR/last.pt` when it exists, else start fresh (saying so); it never takes the next "
        "word otherwise: `--resume /data/imagenet` resumes and trains /data/imagenet",
        "checkpoints", "PATH", nargs="?", const=RESUME_AUTO)
    checkpoint_interval: tuple[Optional[int], Optional[float]] = option(
        (None, None), "also checkpoint mid-epoch: every N steps (`500`), every T (`10m`, `90s`, `2h`), or both "
        "(`500,10m`)", "checkpoints", "EVERY", shown_default="", type=options.checkpoint_interval)
    evaluate: bool = option(False, "validate the `--resume` checkpoint (and its weight average, where it keeps one) "
                            "and exit, through `imagenet-elastic evaluate`'s code path; its model (--model, "
                            "--pretrained, --blurpool) and validation sizes (--image-size, --val-crop-size, "
                            "--val-resize) are the checkpoint's unless given", "run", action="store_true")
    max_steps_per_epoch: Optional[int] = option(None, "cap for smoke runs", "run", "N", type=options.positive_int,
                                                exact=True)

    def __post_init__(self) -> None:
        """What no single option's type can check: ranges of two values, and options that exclude each other."""
        check_each(vars(self))
        if (self.progressive_resize is None) != (self.progressive_epochs is None):
            pair = ("--progressive-resize", "--progressive-epochs")
            given, missing = pair if self.progressive_epochs is None else pair[::-1]
            raise UserError(f"{given} needs {missing} too")
        if self.bce_target_thresh is not None and not self.bce_loss:
            raise UserError("--bce-target-thresh applies to --bce-loss only")
        for weight in ("task_loss_weight", "distill_loss_weight"):
            if getattr(self, weight) is not None and not self.teacher:
                raise UserError(f"--{weight.replace('_', '-')} weighs a distillation loss: it needs --teacher")
        if self.task_loss_weight == 0 and self.distill_loss_weight == 0:
            raise UserError("--task-loss-weight 0 and --distill-loss-weight 0 make the loss 0, which trains nothing: "
                            "give one of them a weight")
        if self.teacher and self.distill_loss_weight is None and (self.task_loss_weight or 0.0) > 1.0:
            raise UserError(f"--task-loss-weight {self.task_loss_weight:g} alone gives the distillation loss the "
                            f"weight 1 - {self.task_loss_weight:g} < 0: set --distill-loss-weight too")
        for name in ("initial_checkpoint", "teacher", "val_path", "val_labels"):  # a script's unset variable
            if getattr(self, name, None) == "":
                raise UserError(f"--{name.replace('_', '-')} is empty: give it a path or name, or leave it out")
        if self.pretrained and self.initial_checkpoint:
            raise UserError("--pretrained and --initial-checkpoint both say where a fresh run's weights come from: "
                            "pass one")
        if self.model.startswith(WEIGHT_SOURCES) and not self.pretrained:
            raise UserError(f"--model {self.model} names published weights: add --pretrained")

    @property
    def train_sizes(self) -> TrainSizes:
        return TrainSizes(self.image_size, self.progressive_resize, self.progressive_epochs)

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def eval_crop(self) -> int:
        return eval_sizes(self.image_size, self.val_crop_size, self.val_resize)[0]

    @property
    def eval_resize(self) -> int:
        return eval_sizes(self.image_size, self.val_crop_size, self.val_resize)[1]

    @property
    def checkpoint_every_steps(self) -> Optional[int]:
        return self.checkpoint_interval[0]

    @property
    def checkpoint_every_seconds(self) -> Optional[float]:
        return self.checkpoint_interval[1]

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so checkpoints load with weights_only=True."""
        return dataclasses.asdict(self)

    def differences(self, saved: dict[str, Any], names: Optional[tuple[str, ...]] = None) -> list[str]:
        """Human-readable list of the settings `names` that differ from a checkpoint's."""
        mine = self.to_dict()
        names = RESUME_SENSITIVE if names is None else names
        return [f"{k}: checkpoint {saved[k]!r}, now {mine[k]!r}" for k in names if k in saved and saved[k] != mine[k]]


def check_each(values: dict[str, Any]) -> None:
    """What the types of a pair of values cannot check, for those of `values`: for a --config file's values too,
    which its error then names."""
    if "scale" in values:
        check_range("--scale", values["scale"], high=1.0)
    if "ratio" in values:
        check_range("--ratio", values["ratio"])


# Settings whose change between a checkpoint and a resumed run breaks exact continuation: each says so itself
# (`option(..., exact=True)`). --teacher's identity (a hash of its weights) is compared instead
# (models/teacher_weights.compare).
RESUME_SENSITIVE = tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("exact"))


def saved_setting(settings: dict[str, Any], name: str) -> Any:
    """A setting from a checkpoint's saved `config`; one saved before the setting existed ran with its default."""
    return settings.get(name, Config.__dataclass_fields__[name].default)


def saved_eval_sizes(settings: dict[str, Any]) -> tuple[int, int]:
    """`eval_sizes` of a checkpoint's run, from its saved settings."""
    return eval_sizes(saved_setting(settings, "image_size"), settings.get("val_crop_size"), settings.get("val_resize"))


def eval_sizes(image_size: int, val_crop_size: Optional[int], val_resize: Optional[int]) -> tuple[int, int]:
    """Validation's centre crop and the short side it is cut from."""
    crop = val_crop_size or image_size
    return crop, val_resize or round(crop / 0.875)


def flag(f: dataclasses.Field) -> str:
    """`--batch-size` for batch_size; DATA for the positional data folder."""
    return f.metadata.get("metavar", "DATA") if f.metadata.get("positional") else "--" + f.name.replace("_", "-")


def add_setting(parser: Any, name: str, **overrides: Any) -> None:
    """The option of setting `name` on `parser`, as the trainer's command line has it (`overrides`: what differs)."""
    f = Config.__dataclass_fields__[name]
    meta = f.metadata
    options: dict[str, Any] = dict(meta["argparse"])
    if meta["metavar"]:
        options["metavar"] = meta["metavar"]
    help_text = meta["help"]
    if meta.get("shown_default"):  # an unset value that means something (`cores / processes per node`)
        help_text += f" (default: {meta['shown_default'].replace('`', '')})"
    options.update({"default": f.default, "help": help_text, **overrides})
    parser.add_argument(flag(f), dest=f.name, **options)


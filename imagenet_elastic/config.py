"""The run's settings: built once from the command line, frozen, and saved in every checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from imagenet_elastic.preemption import DEFAULT_SIGNALS

RESUME_AUTO = "auto"  # `--resume` without a path: CHECKPOINTS/last.pt when it exists, else a fresh start

# Settings whose change between a checkpoint and a resumed run breaks exact continuation.
RESUME_SENSITIVE = (
    "batch_size", "lr", "momentum", "weight_decay", "warmup_epochs", "epochs", "label_smoothing",
    "seed", "image_size", "amp", "max_steps_per_epoch",
)


@dataclass(frozen=True)
class Config:
    data: str
    val_path: Optional[str] = None
    model: str = "resnet50"
    image_size: int = 224
    val_resize: Optional[int] = None  # None: image_size / 0.875, the usual 256 for 224
    epochs: int = 90
    batch_size: int = 64  # per process and forward pass (a micro-batch when accumulating)
    global_batch_size: Optional[int] = None  # None: the checkpoint's, else batch_size x world size
    lr: float = 0.1  # for a global batch of 256, scaled linearly
    momentum: float = 0.9
    weight_decay: float = 1e-4
    warmup_epochs: float = 5.0
    label_smoothing: float = 0.1
    workers: Optional[int] = None  # None: the cores per process, at most 8
    seed: int = 0
    amp: str = "auto"  # auto | bf16 | fp16 | none
    channels_last: bool = True  # NHWC: faster on GPUs and on CPUs (docs/BENCHMARKS.md)
    compile: bool = False  # torch.compile the model before DDP wraps it
    decode: str = "cpu"  # cpu: in loader workers | gpu: batched on the device (gpu_decode.py)
    device: str = "auto"  # auto | cpu | cuda
    threads: Optional[int] = None  # intra-op threads per process; None: cores / local processes
    checkpoints_path: str = "./checkpoints"
    keep_checkpoints: int = 3
    checkpoint_every_steps: Optional[int] = None  # besides every epoch's end
    checkpoint_every_seconds: Optional[float] = None
    async_checkpoint: bool = True  # write checkpoints in a background thread from a host copy
    preempt_signals: tuple[str, ...] = DEFAULT_SIGNALS
    requeue_on_preempt: bool = False
    resume: Optional[str] = None  # None, RESUME_AUTO or a path
    evaluate: bool = False
    dist_init_method: str = "env"  # env | slurm | spawn | mpi
    dist_timeout: float = 300.0
    nproc_per_node: Optional[int] = None  # spawn, and Slurm's one-task-per-node layout
    master_port: Optional[int] = None
    dist_url: Optional[str] = None  # tcp://HOST:PORT of rank 0 (mpi)
    max_steps_per_epoch: Optional[int] = None
    log_interval: int = 50

    @property
    def eval_resize(self) -> int:
        return self.val_resize or round(self.image_size / 0.875)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so checkpoints load with weights_only=True."""
        return dataclasses.asdict(self)

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """Human-readable list of resume-sensitive settings that differ from a checkpoint's."""
        mine = self.to_dict()
        return [f"{k}: checkpoint {saved[k]!r}, now {mine[k]!r}"
                for k in RESUME_SENSITIVE if k in saved and saved[k] != mine[k]]

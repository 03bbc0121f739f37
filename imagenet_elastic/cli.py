"""Command line to frozen Config, launcher variables to DistEnv, and one-line errors for the user."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, Optional

from imagenet_elastic.config import RESUME_AUTO, Config
from imagenet_elastic.errors import PREEMPTED_EXIT, PROG, USER_ERROR_EXIT, UserError
from imagenet_elastic.preemption import parse_signals


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, no usage dump: `imagenet-elastic: error: argument --batch-size: ...`."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where it says something the help text does not."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def _bounded(kind: type, low: float, inclusive: bool = True):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < low or (not inclusive and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low}, got {text}")
        return value
    return parse


_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_checkpoint_interval(text: str) -> tuple[Optional[int], Optional[float]]:
    """`500` (steps), `10m` / `90s` / `2h` (time), or both: `500,10m` -> (500, 600.0)."""
    steps: Optional[int] = None
    seconds: Optional[float] = None
    try:
        for item in (part.strip().lower() for part in text.split(",")):
            if item and item[-1] in _UNITS:
                seconds = float(item[:-1]) * _UNITS[item[-1]]
            else:
                steps = int(item)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected steps (500), a time (10m, 90s, 2h) or both (500,10m), got {text!r}") from None
    if (steps is not None and steps <= 0) or (seconds is not None and seconds <= 0):
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return steps, seconds


def _signals(text: str) -> tuple[str, ...]:
    try:
        return parse_signals(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).split(": ", 1)[-1]) from None


positive_int = _bounded(int, 1)
non_negative_int = _bounded(int, 0)
non_negative_float = _bounded(float, 0.0)
positive_float = _bounded(float, 0.0, inclusive=False)


def build_parser() -> Parser:
    d = Config(data="")
    p = Parser(prog=PROG, description="Train an ImageNet classifier with DDP; survives restarts.",
               formatter_class=HelpFormatter)
    p.add_argument("data", metavar="DATA", help="ImageFolder root with train/ and val/ (or the train folder itself)")
    p.add_argument("--val-path", default=None, help="validation folder (default DATA/val)")
    g = p.add_argument_group("model and optimisation")
    g.add_argument("--model", default=d.model, help="any timm model name (random init)")
    g.add_argument("--image-size", type=positive_int, default=d.image_size, help="train and val crop size")
    g.add_argument("--val-resize", type=positive_int, default=None, help="val short side before the centre crop "
                   "(default image-size/0.875)")
    g.add_argument("--epochs", type=positive_int, default=d.epochs)
    g.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="per process and forward pass; a larger per-process share is accumulated")
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="samples per optimizer step over all processes, kept when the world size changes "
                   "(default: the checkpoint's, else batch-size x processes)")
    g.add_argument("--lr", type=positive_float, default=d.lr, help="for a global batch of 256, scaled linearly")
    g.add_argument("--momentum", type=non_negative_float, default=d.momentum)
    g.add_argument("--weight-decay", type=non_negative_float, default=d.weight_decay, help="not on norms and biases")
    g.add_argument("--warmup-epochs", type=non_negative_float, default=d.warmup_epochs)
    g.add_argument("--label-smoothing", type=non_negative_float, default=d.label_smoothing)
    g.add_argument("--seed", type=non_negative_int, default=d.seed)
    g.add_argument("--amp", choices=["auto", "bf16", "fp16", "none"], default=d.amp,
                   help="auto: bf16 on CPUs and on GPUs that support it, else fp16")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=d.channels_last,
                   help="NHWC memory format (faster on GPUs and CPUs alike)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (before DDP); checkpoints stay interchangeable with eager runs")
    g = p.add_argument_group("run")
    g.add_argument("--workers", type=non_negative_int, default=None, help="loader processes per rank "
                   "(default: cores per process - 1, at most 8)")
    g.add_argument("--decode", choices=["cpu", "gpu"], default=d.decode,
                   help="cpu: loader workers decode; gpu: workers read files, the device decodes batches (nvJPEG)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per rank (default: cores per process)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    g.add_argument("--max-steps-per-epoch", type=positive_int, default=None, help="cap for smoke runs")
    g.add_argument("--log-interval", type=positive_int, default=d.log_interval, help="steps between log lines")
    g.add_argument("--evaluate", action="store_true", help="validate the --resume checkpoint and exit")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoints-path", default=d.checkpoints_path)
    g.add_argument("--keep-checkpoints", type=non_negative_int, default=d.keep_checkpoints,
                   help="newest epoch_NNNN.pt files to keep")
    g.add_argument("--resume", nargs="?", const=RESUME_AUTO, default=None, metavar="PATH",
                   help="continue from PATH; without PATH from CHECKPOINTS/last.pt when it exists")
    g.add_argument("--checkpoint-interval", type=parse_checkpoint_interval, default=None, metavar="EVERY",
                   help="also checkpoint mid-epoch: every N steps (500), every T time (10m, 90s, 2h), or both "
                   "(500,10m)")
    g.add_argument("--async-checkpoint", action=argparse.BooleanOptionalAction, default=d.async_checkpoint,
                   help="write checkpoints in a background thread: training waits only for a copy of the state "
                   "in host memory; a stop, the end of the run and errors wait for the write in flight")
    g.add_argument("--preempt-signals", type=_signals, default=d.preempt_signals, metavar="SIGNALS",
                   help=f"signals that mean checkpoint at the next step and exit {PREEMPTED_EXIT}, or none "
                   f"(default: {','.join(d.preempt_signals)})")
    g.add_argument("--requeue-on-preempt", action="store_true",
                   help="after a preemption checkpoint, rank 0 runs `scontrol requeue` for this Slurm job")
    g = p.add_argument_group("distributed")
    g.add_argument("--dist-init-method", choices=["env", "slurm", "spawn", "mpi"], default=d.dist_init_method,
                   help="how ranks are found: env (torchrun/torch.distributed.launch variables, or none for one "
                   "process), slurm (SLURM_* of srun), spawn (start --nproc-per-node local processes), "
                   "mpi (OMPI_COMM_WORLD_* / PMI_*)")
    g.add_argument("--nproc-per-node", type=positive_int, default=None,
                   help="processes to start: spawn (default: visible GPUs, else 1) and Slurm with one task per "
                   "node (default: its visible GPUs)")
    g.add_argument("--master-port", type=_bounded(int, 1), default=None,
                   help="rendezvous port for slurm/mpi/spawn (default: MASTER_PORT, or derived from SLURM_JOB_ID)")
    g.add_argument("--dist-url", default=None, help="tcp://HOST:PORT of rank 0, for mpi across nodes")
    g.add_argument("--dist-timeout", type=positive_float, default=d.dist_timeout,
                   help="seconds to wait for peers before failing with a clear message")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=non_negative_int, default=None,
                   help=argparse.SUPPRESS)  # passed by python -m torch.distributed.launch
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    fields = {k: v for k, v in vars(args).items() if k not in ("local_rank", "checkpoint_interval")}
    steps, seconds = args.checkpoint_interval or (None, None)
    return Config(**fields, checkpoint_every_steps=steps, checkpoint_every_seconds=seconds)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["benchmark"]:  # a data folder called "benchmark" is ./benchmark
        from imagenet_elastic.benchmark import main as benchmark
        benchmark(argv[1:])
        return
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    from imagenet_elastic.distributed import DistEnv, visible_gpu_count
    from imagenet_elastic.launch import report_user_error, run_worker, spawn_workers
    from imagenet_elastic.launchers import resolve_launch

    try:
        plan = resolve_launch(config.dist_init_method, os.environ, local_rank_arg=args.local_rank,
                              nproc_per_node=config.nproc_per_node, master_port=config.master_port,
                              dist_url=config.dist_url, visible_gpus=visible_gpu_count(os.environ))
    except UserError as error:  # no rank is known yet: every process reports
        report_user_error(error, DistEnv())
        sys.exit(USER_ERROR_EXIT)
    try:
        if plan.procs_per_task > 1 or config.dist_init_method == "spawn":
            spawn_workers(config, plan.env, plan.procs_per_task)
        else:
            run_worker(config, plan.env)
    except KeyboardInterrupt:
        sys.exit(130)


def program() -> NoReturn:
    """`python -m imagenet_elastic` and the `imagenet-elastic` command: `main`, then an exit that skips
    the interpreter's teardown.

    Once torch is imported, that teardown (freeing every module, then the C++ libraries' static
    objects) takes 1-2 s on a small machine, paid by every rank at every restart, and it is where
    gloo's occasional abort at exit came from. By then the run has closed its files, loaders and
    process group itself; the exit handlers still run. A crash keeps Python's ordinary exit and
    traceback. `main` itself returns, so a Python caller keeps its interpreter.
    """
    try:
        main()
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message")
            sys.stderr.write(f"{stop.code}\n")
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`): nothing more to say
            stream.flush()
    os._exit(code)

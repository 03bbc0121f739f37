"""Who am I in the job: rank discovery from launcher variables, process group, device and threads."""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from imagenet_elastic.errors import UserError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as a launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT; >0 means "resume"
    launched: bool = False  # False: a plain single process, no process group at all

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_var(environ: Mapping[str, str], name: str, launcher: str) -> int:
    value = environ.get(name)
    if value is None:
        raise UserError(f"environment variable {name} is not set (it is set by {launcher})")
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def env_from_torchrun(environ: Mapping[str, str], local_rank_arg: Optional[int] = None) -> DistEnv:
    """Read torchrun / torch.distributed.launch variables; none at all means one plain process.

    `local_rank_arg` is the legacy `--local_rank` / `--local-rank` argument that
    `python -m torch.distributed.launch` passes; LOCAL_RANK in the environment wins when both exist.
    """
    present = [name for name in TORCHRUN_VARS if name in environ]
    if not present and local_rank_arg is None:
        return DistEnv()
    launcher = "torchrun or torch.distributed.launch"
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in environ]
    if missing:
        raise UserError(
            f"--dist-init-method env found {', '.join(present) or '--local-rank'} but not "
            f"{', '.join(missing)}; these variables are set by {launcher}"
        )
    rank = _int_var(environ, "RANK", launcher)
    world_size = _int_var(environ, "WORLD_SIZE", launcher)
    if "LOCAL_RANK" in environ:
        local_rank = _int_var(environ, "LOCAL_RANK", launcher)
    elif local_rank_arg is not None:
        local_rank = local_rank_arg
    else:
        raise UserError(f"environment variable LOCAL_RANK is not set (it is set by {launcher})")
    local_world_size = (_int_var(environ, "LOCAL_WORLD_SIZE", launcher)
                        if "LOCAL_WORLD_SIZE" in environ else world_size)
    if not (0 <= rank < world_size):
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=environ["MASTER_ADDR"],
        master_port=_int_var(environ, "MASTER_PORT", launcher),
        restart_count=(_int_var(environ, "TORCHELASTIC_RESTART_COUNT", launcher)
                       if environ.get("TORCHELASTIC_RESTART_COUNT") else 0),
        launched=True,
    )


def resolve_dist_env(method: str, environ: Mapping[str, str], local_rank_arg: Optional[int] = None) -> DistEnv:
    if method == "env":
        return env_from_torchrun(environ, local_rank_arg)
    raise UserError(f"--dist-init-method {method!r} is not supported; choose env")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(local_world_size: int) -> int:
    """Same policy under every launcher: the cores shared evenly by the processes of one node.

    torchrun sets OMP_NUM_THREADS=1 while srun, mpirun and spawn set nothing; applying one rule here
    keeps CPU results bitwise identical across launchers and avoids oversubscribing cores.
    """
    return max(1, available_cores() // max(1, local_world_size))


def configure_threads(requested: Optional[int], local_world_size: int) -> int:
    threads = requested or default_threads(local_world_size)
    torch.set_num_threads(threads)
    return threads


def select_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda was given but no CUDA device is visible")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible "
                        "(check CUDA_VISIBLE_DEVICES and the processes per node)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float) -> None:
    """Join the job's process group through a store prefix unique to this torchrun round.

    Under torchrun the workers share the agent's TCPStore. Keys from a previous round (its gloo peer
    addresses) are still there after a restart; reading them made restarts fail with "connection
    refused". A prefix named after TORCHELASTIC_RESTART_COUNT gives every round a clean namespace.
    """
    if not env.launched:
        return
    timeout = timedelta(seconds=timeout_s)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0 and not agent_hosts_store, timeout=timeout)
    except (RuntimeError, OSError) as error:
        raise UserError(
            f"rank {env.rank} could not reach the rendezvous store at "
            f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port} within {timeout_s:g} s "
            f"(--dist-timeout): {str(error).splitlines()[0]}"
        ) from None
    store = dist.PrefixStore(f"imagenet_elastic/round{env.restart_count}", store)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


def destroy_process_group() -> None:
    """Tear down after the caller dropped its DDP model and tensors.

    gloo can abort at interpreter exit ("terminate called without an active exception") while
    DDP objects are still alive; collecting them first made that go away.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    if is_initialized():
        dist.barrier()

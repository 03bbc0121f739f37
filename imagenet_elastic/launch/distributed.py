"""This process in the job (launchers.py says who it is): its device and threads, the process group, collectives."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from imagenet_elastic.errors import FailedOnRank0, RendezvousError, UserError, first_line, one_line
from imagenet_elastic.launch.launchers import DistEnv


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(local_world_size: int) -> int:
    """The node's cores shared evenly by its processes, under every launcher: torchrun sets OMP_NUM_THREADS=1 while
    srun, mpirun and spawn set nothing; one rule keeps CPU results bitwise identical and avoids oversubscription."""
    return max(1, available_cores() // max(1, local_world_size))


def configure_threads(requested: Optional[int], local_world_size: int) -> int:
    torch.set_num_threads(requested or default_threads(local_world_size))
    return torch.get_num_threads()


def visible_gpu_count(environ: Mapping[str, str]) -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES's entries when set (Slurm sets it per task, also before a
    driver is loaded), else what CUDA reports."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # CUDA hides everything from an invalid id on
        entries = [entry.strip() for entry in visible.split(",")]
        return next((i for i, entry in enumerate(entries) if not entry or entry.startswith("-")), len(entries))
    return torch.cuda.device_count()


def uses_cuda(requested: str) -> bool:
    """Whether --device REQUESTED trains on CUDA here."""
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def select_device(requested: str, env: DistEnv) -> torch.device:
    """`cuda:i`, i = LOCAL_RANK modulo the visible devices (for Slurm, where a task often sees only its own GPU).
    Otherwise more processes than devices would share a GPU, where NCCL fails later, unexplained: refused."""
    if not uses_cuda(requested):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda was given but no CUDA device is visible")
    count = torch.cuda.device_count()
    if env.local_world_size > count:
        if env.launcher != "srun":
            raise UserError(f"{env.local_world_size} processes per node but only {count} CUDA device(s) visible "
                            "(check CUDA_VISIBLE_DEVICES and the processes per node)")
        if count > 1:  # every task sees the node's GPUs, not its own
            raise UserError(f"{env.local_world_size} Slurm tasks per node but each sees the same {count} GPUs, so "
                            "ranks would share a GPU: ask Slurm for one GPU per task (--gpus-per-task=1) or for as "
                            "many tasks per node as GPUs")
    index = env.local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float) -> None:
    """Join the job's process group in a store namespace that this round alone uses (see `join_round`)."""
    global _control
    if not env.launched:
        return
    timeout = timedelta(seconds=timeout_s)
    hosts = env.rank == 0 and not env.store_is_external
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=hosts, timeout=timeout,
                              wait_for_workers=False)
        namespace = join_round(store, env.rank, env.world_size, timeout_s)
    except (RuntimeError, OSError, TimeoutError) as error:
        if hosts and port_in_use(error):
            raise RendezvousError(f"MASTER_PORT={env.master_port} is already in use on this host, where rank 0 hosts "
                                  "the rendezvous store: choose another port") from None
        raise RendezvousError(f"gave up {'waiting for the other ranks' if hosts else 'connecting'} at MASTER_ADDR="
                              f"{env.master_addr} MASTER_PORT={env.master_port} after {timeout_s:g} s "
                              f"(--dist-timeout): {first_line(error)}") from None
    options = group_options(device)
    dist.init_process_group(store=dist.PrefixStore(namespace, store), rank=env.rank, world_size=env.world_size,
                            timeout=timeout, **options)
    # control messages (stop? checkpoint now?) travel on CPU tensors: agreeing on them never waits for the GPU's queue
    _control = dist.new_group(backend="gloo") if options["backend"] != "gloo" else None


def port_in_use(error: BaseException) -> bool:
    """A store that could not listen on its port, taken by another run or program: it fails at once, unlike a wait."""
    return "EADDRINUSE" in str(error)


def group_options(device: torch.device) -> dict[str, Any]:
    """nccl bound to this rank's GPU (`device_id`: `barrier()` need not guess it, with a warning), or gloo on a CPU."""
    return {"backend": "nccl", "device_id": device} if device.type == "cuda" else {"backend": "gloo"}


_ROUNDS = "imagenet_elastic/rounds"
_control: Optional[dist.ProcessGroup] = None


def join_round(store: dist.Store, rank: int, world_size: int, timeout_s: float, poll_s: float = 0.02) -> str:
    """Agree with the other ranks on a store namespace no earlier round has used: torchrun's agents keep one store
    for the whole job, so a previous round's keys (its gloo peer addresses) survive a restart, and
    TORCHELASTIC_RESTART_COUNT cannot name a round (not raised on a membership change; a late agent counts from 0).
    Rank 0 announces a fresh ticket; each other rank registers its own under it and waits for rank 0 to list it back,
    retrying under a newer announcement if it read a stale one."""
    deadline = time.monotonic() + timeout_s
    ticket = str(store.add(f"{_ROUNDS}/tickets", 1))
    if rank == 0:
        members = [f"{_ROUNDS}/{ticket}/member{r}" for r in range(1, world_size)]
        store.set(f"{_ROUNDS}/leader", ticket)
        wait_for_keys(store, members, deadline, poll_s)
        store.set(f"{_ROUNDS}/{ticket}/go", ",".join(store.get(k).decode() for k in members))
        return f"imagenet_elastic/round{ticket}"
    wait_for_keys(store, [f"{_ROUNDS}/leader"], deadline, poll_s)
    while time.monotonic() < deadline:
        leader = store.get(f"{_ROUNDS}/leader").decode()
        store.set(f"{_ROUNDS}/{leader}/member{rank}", ticket)
        while time.monotonic() < deadline:
            if store.check([f"{_ROUNDS}/{leader}/go"]):
                listed = store.get(f"{_ROUNDS}/{leader}/go").decode().split(",")
                if len(listed) == world_size - 1 and listed[rank - 1] == ticket:
                    return f"imagenet_elastic/round{leader}"
                while store.get(f"{_ROUNDS}/leader").decode() == leader and time.monotonic() < deadline:
                    time.sleep(poll_s)  # a finished round of the past: wait for this round's leader
                break
            if store.get(f"{_ROUNDS}/leader").decode() != leader:
                break
            time.sleep(poll_s)
    raise TimeoutError(f"rank 0 of this round did not answer within {timeout_s:g} s")


def wait_for_keys(store: dist.Store, keys: list[str], deadline: float, poll_s: float) -> None:
    """`store.wait` in sleeps growing to half a second (a thousand ranks polling rank 0's store): a signal's Python
    handler runs only once a C++ wait returns, so a preemption signal to a rank waiting for a late peer would
    otherwise wait up to --dist-timeout (see launch/preemption.py)."""
    while keys and not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [key for key in keys if not store.check([key])]
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise TimeoutError(f"wait timeout, keys missing: {', '.join(missing[:3])}{more}")
        time.sleep(poll_s)
        poll_s = min(0.5, poll_s * 1.5)


def destroy_process_group() -> None:
    """Tear down after the caller dropped its DDP model and tensors, and unfroze what it froze (gc.freeze): gloo can
    abort at exit ("terminate called without an active exception") while DDP objects are alive: collect first."""
    global _control
    _control = None
    gc.collect()
    if is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    """False also on a torch built without distributed support, where `dist.is_initialized` is missing."""
    return dist.is_available() and dist.is_initialized()


def agree(flags: Sequence[bool]) -> list[bool]:
    """Each flag, true on any rank, becomes true on every rank: stop and checkpoint decisions are taken together at
    a step boundary, so no rank waits in a collective the others skipped."""
    if not is_initialized():  # one process: no tensor, so no host read in the step's audit
        return list(flags)
    votes = all_reduce_max(torch.tensor([int(f) for f in flags], dtype=torch.int32))
    return [bool(v) for v in votes.tolist()]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """On CPU tensors, through the control group."""
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control)
    return tensor


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Every rank takes rank 0's buffers (BatchNorm running statistics), one broadcast per dtype: DDP broadcasts them
    before each forward, but each rank then updates its copy from its own micro-batch, and only rank 0's are saved."""
    if not is_initialized():
        return
    buffers = list(module.buffers())
    for dtype in sorted({b.dtype for b in buffers}, key=str):
        same = [b for b in buffers if b.dtype == dtype]
        flat = torch.cat([b.detach().reshape(-1) for b in same])
        dist.broadcast(flat, src=0)
        for buffer, part in zip(same, flat.split([b.numel() for b in same])):
            buffer.copy_(part.view(buffer.shape))


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, through the control group (CPU, never the GPU's queue)."""
    if not is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=_control)
    return gathered


def broadcast_object(obj: Any, src: int) -> Any:
    """Rank `src`'s `obj` on every rank (the others pass anything), through the control group."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_control)
    return box[0]


def rank_0_does(action: Callable[[], None]) -> None:
    """Rank 0 does `action`; one small broadcast tells every rank whether it failed, so each raises the same line
    with rank 0's exit code instead of meeting a vanished peer (gloo's "connection closed by peer", or under NCCL
    nothing until --dist-timeout). Only a UserError is shared; anything else is a bug, with its traceback on rank 0."""
    failure: Optional[tuple[str, int]] = None
    if rank() == 0:
        try:
            action()
        except UserError as error:
            failure = (one_line(error), error.exit_code)
    failure = broadcast_object(failure, src=0)
    if failure is not None:
        raise FailedOnRank0(*failure)


PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe")  # gloo's words for a rank whose process ended


def peer_left(error: BaseException) -> bool:
    """Whether a collective failed because another rank's process ended (e.g. after a second Ctrl-C)."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in PEER_GONE)

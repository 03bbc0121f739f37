"""What each launcher tells a process about the job: environment variables to a LaunchPlan. Pure functions of the
environment (passed in), so every launcher's rules are unit-tested without it."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional
from urllib.parse import urlparse

from imagenet_elastic import options
from imagenet_elastic.errors import UserError
from imagenet_elastic.launch.hostlist import first_host
from imagenet_elastic.options import option

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN = "torchrun or torch.distributed.launch"
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # >0: a restart, which resumes last.pt
# What the rendezvous store (TCPStore) takes: a port, and a world size that fits a C int; a rank is below it
PORTS, WORLD_SIZES, RANKS = (1, 65535), (1, 2**31 - 1), (0, 2**31 - 2)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as its launcher describes it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT; >0 means "resume"
    launched: bool = False  # False: a plain single process, no process group at all
    launcher: str = "none"  # who started us, for messages: torchrun, srun, mpirun, spawn
    store_is_external: bool = False  # the rendezvous store runs elsewhere (torchrun's agent, the spawn parent)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def child(self, index: int, procs: int) -> DistEnv:
        """The `index`-th of `procs` processes this task starts (spawn, Slurm one-task-per-node)."""
        return dataclasses.replace(
            self, rank=self.rank * procs + index, world_size=self.world_size * procs,
            local_rank=self.local_rank * procs + index, local_world_size=self.local_world_size * procs,
            launched=True)


@dataclass(frozen=True)
class LaunchPlan:
    """This process's DistEnv; with procs_per_task > 1 or under spawn, a task that starts its ranks itself."""

    env: DistEnv
    procs_per_task: int = 1

    @property
    def spawns(self) -> bool:
        return self.procs_per_task > 1 or self.env.launcher == "spawn"


def _int_var(environ: Mapping[str, str], name: str, launcher: str, default: Optional[int] = None,
             within: Optional[tuple[int, int]] = None) -> int:
    """`default` where the variable is unset or empty, if given; `within`: the range (LOW, HIGH) it must be in."""
    value = environ.get(name)
    if not value and default is not None:
        return default
    if not value:
        raise UserError(f"environment variable {name} is not set (it is set by {launcher})")
    try:
        number = int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None
    if within and not within[0] <= number <= within[1]:
        raise UserError(f"environment variable {name}={value} is outside {within[0]}..{within[1]}")
    return number


def _in_world(rank_name: str, rank: int, size_name: str, size: int, shown: object = None) -> None:
    """A rank outside its world would wait --dist-timeout for a rendezvous that cannot complete; a local rank outside
    its node's would pick a device that is not its own. `shown`: the size variable's value, where not `size`."""
    if not 0 <= rank < size:
        raise UserError(f"{rank_name}={rank} is outside {size_name}={size if shown is None else shown}")


def _master_port(environ: Mapping[str, str], explicit: Optional[int], default: int) -> int:
    """--master-port, else MASTER_PORT, else the launcher's default."""
    return explicit or _int_var(environ, "MASTER_PORT", "the cluster or the user", default, within=PORTS)


def env_from_torchrun(environ: Mapping[str, str], local_rank_arg: Optional[int] = None) -> DistEnv:
    """torchrun / torch.distributed.launch variables; none at all means one plain process. `local_rank_arg` is the
    `--local-rank` argument torch.distributed.launch passes; LOCAL_RANK in the environment wins."""
    present = [name for name in TORCHRUN_VARS if name in environ]
    if not present and local_rank_arg is None:
        return DistEnv()
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in environ]
    if missing:
        raise UserError(f"--dist-init-method env found {', '.join(present) or '--local-rank'} but not "
                        f"{', '.join(missing)}; these variables are set by {TORCHRUN}")
    if not environ["MASTER_ADDR"]:
        raise UserError(f"environment variable MASTER_ADDR is empty; {TORCHRUN} sets it to rank 0's host")
    rank = _int_var(environ, "RANK", TORCHRUN)
    world_size = _int_var(environ, "WORLD_SIZE", TORCHRUN, within=WORLD_SIZES)
    local_rank = (local_rank_arg if local_rank_arg is not None and "LOCAL_RANK" not in environ
                  else _int_var(environ, "LOCAL_RANK", TORCHRUN, within=RANKS))
    local_world_size = (_int_var(environ, "LOCAL_WORLD_SIZE", TORCHRUN, within=WORLD_SIZES)
                        if "LOCAL_WORLD_SIZE" in environ else world_size)
    _in_world("RANK", rank, "WORLD_SIZE", world_size)
    _in_world("LOCAL_RANK" if "LOCAL_RANK" in environ else "--local-rank", local_rank,
              "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in environ else "WORLD_SIZE", local_world_size)
    return DistEnv(
        rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
        master_addr=environ["MASTER_ADDR"], master_port=_int_var(environ, "MASTER_PORT", TORCHRUN, within=PORTS),
        restart_count=_int_var(environ, "TORCHELASTIC_RESTART_COUNT", TORCHRUN, default=0),
        launched=True, launcher="torchrun",
        # torchrun's agent hosts the store and tells its workers so (torch >= 2.2)
        store_is_external=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Read Slurm's compressed SLURM_TASKS_PER_NODE ("2(x3),1": 2 on nodes 0-2, 1 on node 3)."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise UserError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is not in Slurm's format")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise UserError(f"SLURM_NODEID={node_id} is outside SLURM_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def slurm_master_port(job_id: int) -> int:
    """15000 + SLURM_JOB_ID mod 15000: below Linux's ephemeral range (32768+), different for consecutive jobs."""
    return 15000 + job_id % 15000


def _scontrol_first_host(nodelist: str) -> str:
    if not shutil.which("scontrol"):
        raise UserError(f"cannot expand Slurm nodelist {nodelist!r} and scontrol is not available")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.split():
        raise UserError(f"cannot expand Slurm nodelist {nodelist!r}: {out.stderr.strip()}")
    return out.stdout.split()[0]


def env_from_slurm(environ: Mapping[str, str], master_port: Optional[int] = None,
                   fallback: Callable[[str], str] = _scontrol_first_host) -> DistEnv:
    """One rank per Slurm task (`srun --ntasks-per-node=G`)."""
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID")
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise UserError(f"--dist-init-method slurm looked for {', '.join(names)} but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not set; these are set by srun (inside "
                        "salloc/sbatch allocations too)")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UserError("--dist-init-method slurm looked for SLURM_STEP_NODELIST and SLURM_JOB_NODELIST but "
                        "neither is set; these are set by srun")
    rank, ntasks, local_rank, node_id, job_id = (
        _int_var(environ, name, "srun", within={"SLURM_NTASKS": WORLD_SIZES, "SLURM_JOB_ID": None}.get(name, RANKS))
        for name in names)
    _in_world("SLURM_PROCID", rank, "SLURM_NTASKS", ntasks)
    master_addr = environ.get("MASTER_ADDR")
    if not master_addr:
        try:
            master_addr = first_host(nodelist)
        except UserError:  # `scontrol show hostnames` only where our own parser fails
            master_addr = fallback(nodelist)
    spec_name = "SLURM_STEP_TASKS_PER_NODE" if environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    spec = environ.get(spec_name)
    local_world = tasks_on_node(spec, node_id) if spec else ntasks
    _in_world("SLURM_LOCALID", local_rank, spec_name if spec else "SLURM_NTASKS", local_world,
              f"{spec!r} ({local_world} on SLURM_NODEID={node_id})" if spec else None)
    return DistEnv(rank=rank, world_size=ntasks, local_rank=local_rank, local_world_size=local_world,
                   master_addr=master_addr,
                   master_port=_master_port(environ, master_port, slurm_master_port(job_id)), launched=True,
                   launcher="srun", restart_count=_int_var(environ, "SLURM_RESTART_COUNT", "srun", 0))


def slurm_procs_per_task(environ: Mapping[str, str], nproc_per_node: Optional[int], visible_gpus: int,
                         uses_gpus: bool = False) -> int:
    """Ranks each Slurm task starts: `--nproc-per-node`, else one per visible GPU when a node runs a single task,
    else 1. More ranks than the task's GPUs (ranks sharing a GPU: NCCL fails later, unexplained) are refused."""
    if nproc_per_node:
        if uses_gpus and nproc_per_node > visible_gpus:
            raise UserError(f"--nproc-per-node {nproc_per_node} is more than the {visible_gpus} GPU(s) this Slurm "
                            "task sees (CUDA_VISIBLE_DEVICES): ranks would share a GPU; ask Slurm for "
                            f"--gres=gpu:{nproc_per_node} or pass --nproc-per-node {visible_gpus} (or --device cpu)")
        return nproc_per_node
    node_tasks = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    single_task = node_tasks and tasks_on_node(node_tasks, int(environ.get("SLURM_NODEID") or 0)) == 1
    return visible_gpus if single_task and visible_gpus > 1 else 1


def parse_dist_url(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    try:
        port = parsed.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        port = None
    if parsed.scheme != "tcp" or not parsed.hostname or not port:
        raise UserError(f"--dist-url {url!r} must look like tcp://HOST:PORT")
    return parsed.hostname, port


def _all_set(environ: Mapping[str, str], names: list[str], launcher: str) -> None:
    """A launcher found by some of its variables but not all: each missing one named."""
    missing = [name for name in names if not environ.get(name)]
    if missing:
        raise UserError(f"--dist-init-method mpi found {', '.join(n for n in names if n not in missing)} but not "
                        f"{', '.join(missing)}; these variables are set by {launcher}")


def env_from_mpi(environ: Mapping[str, str], dist_url: Optional[str] = None,
                 master_port: Optional[int] = None) -> DistEnv:
    """OpenMPI's OMPI_COMM_WORLD_* (or MPICH/Intel MPI's PMI_*). MPI only launches: the process group is still
    gloo or nccl, so MASTER_ADDR/PORT come from the environment or --dist-url."""
    ompi = [f"OMPI_COMM_WORLD_{name}" for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")]
    if any(environ.get(name) for name in ompi):
        launcher = "OpenMPI's mpirun"
        _all_set(environ, ompi, launcher)
        rank, world, local_rank, local_world = (_int_var(environ, name, launcher,
                                                         within=WORLD_SIZES if name.endswith("SIZE") else RANKS)
                                                for name in ompi)
        _in_world(ompi[0], rank, ompi[1], world)
        _in_world(ompi[2], local_rank, ompi[3], local_world)
    elif environ.get("PMI_SIZE") or environ.get("PMI_RANK"):
        launcher = "MPICH/Intel MPI's mpiexec"
        _all_set(environ, ["PMI_RANK", "PMI_SIZE"], launcher)
        rank = _int_var(environ, "PMI_RANK", launcher, within=RANKS)
        world = _int_var(environ, "PMI_SIZE", launcher, within=WORLD_SIZES)
        _in_world("PMI_RANK", rank, "PMI_SIZE", world)
        rank_var = "MPI_LOCALRANKID" if environ.get("MPI_LOCALRANKID") else "PMI_LOCAL_RANK"  # Intel MPI's, MPICH's
        size_var = next((name for name in ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE") if environ.get(name)), "PMI_SIZE")
        local_rank = _int_var(environ, rank_var, launcher, 0, within=RANKS)
        local_world = _int_var(environ, size_var, launcher, world, within=WORLD_SIZES)
        _in_world(rank_var, local_rank, size_var, local_world)
    else:
        raise UserError("--dist-init-method mpi looked for OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK (OpenMPI) and "
                        "PMI_RANK/PMI_SIZE (MPICH, Intel MPI) but none is set; these are set by mpirun/mpiexec")
    if dist_url:
        addr, port = parse_dist_url(dist_url)
    else:
        addr, port = environ.get("MASTER_ADDR") or "127.0.0.1", _master_port(environ, master_port, 29500)
    if world > local_world and addr in ("127.0.0.1", "localhost"):
        raise UserError(f"mpi job spans several nodes ({world} ranks, {local_world} here): set MASTER_ADDR "
                        "or --dist-url tcp://RANK0_HOST:PORT")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   master_addr=addr, master_port=port, launched=True, launcher="mpirun")


@dataclass(frozen=True)
class LaunchRequest:
    """What the command line says about the launch, beside the launcher's variables."""

    local_rank_arg: Optional[int] = None
    nproc_per_node: Optional[int] = None
    master_port: Optional[int] = None
    dist_url: Optional[str] = None
    visible_gpus: int = 0
    uses_gpus: bool = False


def plan_env(environ: Mapping[str, str], request: LaunchRequest) -> LaunchPlan:
    """N copies of a single-process run would overwrite each other's checkpoints: under another launcher, say what
    to pass. SLURM_STEP_NUM_TASKS is set by srun for its tasks, not in an sbatch script, where one process is fine."""
    env = env_from_torchrun(environ, request.local_rank_arg)
    for var, method, launcher in (("SLURM_STEP_NUM_TASKS", "slurm", "srun"),
                                  ("OMPI_COMM_WORLD_SIZE", "mpi", "mpirun"), ("PMI_SIZE", "mpi", "mpiexec")):
        if not env.launched and environ.get(var, "").isdigit() and int(environ[var]) > 1:
            raise UserError(f"started by {launcher} with {var}={environ[var]} but --dist-init-method is env "
                            f"(torchrun variables); pass --dist-init-method {method}")
    return LaunchPlan(env)


def plan_slurm(environ: Mapping[str, str], request: LaunchRequest) -> LaunchPlan:
    if {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= environ.keys():  # `srun torchrun ...`: torchrun's view of the job wins
        return LaunchPlan(env_from_torchrun(environ, request.local_rank_arg))
    env = env_from_slurm(environ, request.master_port)
    procs = slurm_procs_per_task(environ, request.nproc_per_node, request.visible_gpus, request.uses_gpus)
    return LaunchPlan(env, procs)


class LaunchMethod(NamedTuple):
    plan: Callable[[Mapping[str, str], LaunchRequest], LaunchPlan]  # how this way of being started becomes a plan
    help: str  # for --dist-init-method's help


METHODS: dict[str, LaunchMethod] = {
    "env": LaunchMethod(plan_env, "torchrun or torch.distributed.launch variables, or none for one process"),
    "slurm": LaunchMethod(plan_slurm, "srun's `SLURM_*`"),
    "spawn": LaunchMethod(lambda _, r: LaunchPlan(  # master port 0: the parent's store picks a free one
        DistEnv(master_port=r.master_port or 0, launcher="spawn", store_is_external=True),
        r.nproc_per_node or max(1, r.visible_gpus)), "start --nproc-per-node local processes"),
    "mpi": LaunchMethod(lambda environ, r: LaunchPlan(env_from_mpi(environ, r.dist_url, r.master_port)),
                        "`OMPI_COMM_WORLD_*` or `PMI_*`"),
}


@dataclass(frozen=True)
class LaunchSettings:
    """Where the ranks come from (one of `METHODS`), how they meet, and the threads each one runs."""

    dist_init_method: str = option(
        "env", "where ranks come from (docs/LAUNCHING.md): " + options.described(METHODS), "distributed",
        choices=list(METHODS))
    nproc_per_node: Optional[int] = option(None, "processes to start: spawn, and Slurm with one task per node",
                                           "distributed", "N", shown_default="visible GPUs, else 1",
                                           type=options.per_node_count)
    master_port: Optional[int] = option(None, "rendezvous port for slurm/mpi/spawn (Slurm default: from the job id)",
                                        "distributed", "N", type=options.port_number)
    dist_url: Optional[str] = option(None, "rank 0's address for mpi across nodes", "distributed",
                                     "tcp://HOST:PORT")
    dist_timeout: float = option(300.0, "how long to wait for peers and the rendezvous store", "distributed",
                                 "SECONDS", type=options.timeout_seconds)
    threads: Optional[int] = option(None, "torch threads per rank, the same rule under every launcher", "run", "N",
                                    shown_default="cores / processes per node", type=options.per_node_count)


# the methods that read each of these flags
FLAG_METHODS = {"nproc_per_node": ("spawn", "slurm"), "master_port": ("slurm", "mpi", "spawn"), "dist_url": ("mpi",)}


def ignored_flags(method: str, request: LaunchRequest) -> list[str]:
    """Flags given that `method` does not read: a recipe may carry them, so they are said, not refused."""
    return [f"--{name.replace('_', '-')} is for --dist-init-method {' or '.join(methods)}; ignored under {method}"
            for name, methods in FLAG_METHODS.items() if getattr(request, name) is not None and method not in methods]


def resolve_launch(method: str, environ: Mapping[str, str], **request: Any) -> LaunchPlan:
    """`request`: LaunchRequest's fields. Rank 0 warns of the flags the method ignores."""
    if method not in METHODS:
        raise UserError(f"--dist-init-method {method!r} is not supported; choose {', '.join(METHODS)}")
    asked = LaunchRequest(**request)
    plan = METHODS[method].plan(environ, asked)
    for line in ignored_flags(method, asked) if plan.env.is_main else ():
        print(f"warning: {line}", file=sys.stderr, flush=True)
    return plan


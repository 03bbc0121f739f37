"""Fault injection against real torchrun jobs on this machine: kill workers, kill and add agents, send
preemption signals, then measure what each fault cost from the sample log and the timestamped output.

A test harness, outside the installed package: used by the tests and by scripts/fault_injection_demo.py
(which prints the table in docs/LAUNCHING.md's "Fault tolerance"). Each torchrun agent stands for one node.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from imagenet_elastic.report.samplelog import ENV_VAR as SAMPLE_LOG_VAR
from imagenet_elastic.report.samplelog import coverage

# Rendezvous settings that re-form a group in seconds instead of torchrun's ~46 s: a lost agent is
# noticed after 3 missed 1-s heartbeats, and a round closes 3 s after its minimum size is reached.
FAST_RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
# torchrun's agents share one TCP store with their workers unless this is set. With it shared, an agent
# that joins a running job hangs in rendezvous (torch 2.6-2.13: the rank-0 agent publishes the store's
# address only in the first round it is rank 0, so the joiner waits for keys that never come).
SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RESUMED = re.compile(r"first step [\d.]+ s after the checkpoint was written")
_HANDOFF_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "SLURM_", "OMPI_", SAMPLE_LOG_VAR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):  # the process ended while we looked
                continue
    return found


def stop(pid: int, timeout: float = 10) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped. kill() returns before that:
    a thread inside a system call (a rename, an fsync) finishes the call first, so what it changes on
    disk is only settled once /proc shows every thread in state T."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):  # the thread ended while we looked
                continue
        if all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.001)


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def workers_by_rank(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of a torchrun agent's worker processes."""
    found = {}
    for pid in children_of(agent_pid):
        try:
            rank = process_env(pid).get("RANK")
        except OSError:
            continue
        if rank is not None:
            found[int(rank)] = pid
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus any launcher variables, so a test run inside Slurm or torchrun stays local,
    and without CUDA devices, so it trains on the CPU with gloo on a GPU machine too (`--device auto`
    would otherwise pick the GPU, and 2-3 ranks on one GPU are refused). Slurm's gres still sets the
    variable of its own tasks; a test about CUDA passes CUDA_VISIBLE_DEVICES in `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_HANDOFF_VARS)}
    env.update({"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **extra})
    return env


def torchrun_cmd(nproc: int, trainer_args: list[str], restarts: int = 0,
                 endpoint: Optional[str] = None, run_id: str = "fault-injection") -> list[str]:
    """`--standalone` by default; with `endpoint`, an elastic agent of a 1:2-node c10d job."""
    rdzv = ["--standalone"] if endpoint is None else [
        "--nnodes=1:2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={FAST_RDZV_CONF}"]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}", "-m", "imagenet_elastic", *trainer_args]


class Agent:
    """One process tree (a torchrun agent and its workers, or one trainer), its output read line by
    line and time-stamped as it arrives."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append((time.monotonic(), line))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def find(self, pattern: str, after: float = 0.0) -> Optional[tuple[float, str]]:
        regex = re.compile(pattern)
        return next(((t, line) for t, line in self.lines if t >= after and regex.search(line)), None)

    def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> tuple[float, str]:
        """The first line at or after `after` that matches; an error if the process ends or time runs out."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while (found := self.find(pattern, after)) is None:
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"exited with {self.proc.returncode} before {pattern!r}:\n{self.output}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no line matching {pattern!r} within {timeout} s:\n{self.output}")
                self._changed.wait(timeout=min(remaining, 1.0))
        return found

    def workers(self) -> list[int]:
        """The agent's worker processes (children with RANK set)."""
        return list(workers_by_rank(self.proc.pid).values())

    def signal_workers(self, sig: int) -> list[int]:
        pids = self.workers()
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def kill_node(self) -> None:
        """The node is gone: the agent and every worker (each worker leads its own process group)."""
        for pid in self.workers():
            _killpg(pid)
        _killpg(self.proc.pid)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill_node()
            self._reader.join(timeout=10)


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@dataclass
class Outcome:
    """One scenario's row of the demo table."""

    scenario: str
    faults: int
    restarts: int
    samples_lost: int
    samples_repeated: int
    steps_redone: int
    world_sizes: tuple[int, ...]
    recovery_s: list[float]  # each fault to the first training step after it
    seconds_lost: float  # wall time beyond the uninterrupted run, per fault
    weights: str  # "bitwise" or the largest absolute difference to the uninterrupted run


def compare_weights(path: Path, reference: Path, key: str = "model") -> float:
    """Largest absolute difference over the floating-point tensors of two checkpoints' models (or, with
    `key="model_ema"`, their weight averages).

    Integer buffers (batch norm's num_batches_tracked) are left out: they count forward passes,
    which gradient accumulation multiplies.
    """
    a = torch.load(path, map_location="cpu", weights_only=True)[key]
    b = torch.load(reference, map_location="cpu", weights_only=True)[key]
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()),
               default=0.0)


def weights_text(path: Path, reference: Path) -> str:
    largest = compare_weights(path, reference)
    return "bitwise" if largest == 0 else f"max |diff| {largest:.1e}"


@dataclass(frozen=True)
class Job:
    """What every scenario trains: same data and settings, so each can be compared with one clean run."""

    data: str
    trainer_args: tuple[str, ...]
    samples_per_epoch: int
    global_batch: int
    workdir: Path

    def fresh(self, name: str) -> str:
        """Start scenario `name` from nothing: no checkpoints or sample log of an earlier demo run."""
        shutil.rmtree(self.workdir / name, ignore_errors=True)
        return name

    def args(self, name: str, *extra: str) -> list[str]:
        return [self.data, *self.trainer_args, "--checkpoints-path", str(self.workdir / name / "ckpt"), *extra]

    def env(self, name: str) -> dict[str, str]:
        return clean_env(**{SAMPLE_LOG_VAR: str(self.workdir / name / "samples")})

    def last(self, name: str) -> Path:
        return self.workdir / name / "ckpt" / "last.pt"

    def outcome(self, name: str, scenario: str, faults: int, restarts: int, recovery: list[float],
                wall: float, clean_wall: float) -> Outcome:
        report = coverage(str(self.workdir / name / "samples"), self.samples_per_epoch, self.global_batch)
        return Outcome(scenario, faults, restarts, report.samples_lost, report.samples_repeated, report.steps_redone,
                       report.world_sizes, recovery, max(0.0, wall - clean_wall) / max(1, faults),
                       weights_text(self.last(name), self.last("clean")))


def run_clean(job: Job, timeout: float = 600) -> float:
    """The uninterrupted two-process run every scenario is compared with; returns its wall time."""
    job.fresh("clean")
    start = time.monotonic()
    agent = Agent(torchrun_cmd(2, job.args("clean")), job.env("clean"))
    if agent.wait(timeout) != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{agent.output}")
    return time.monotonic() - start


def step_line(epoch: int, step: int, epochs: int) -> str:
    return rf"epoch {epoch}/{epochs} step {step}/"


def worker_kills(job: Job, targets: list[tuple[int, int, int]], epochs: int, clean_wall: float,
                 timeout: float = 600) -> Outcome:
    """SIGKILL worker `rank` when rank 0 reports (epoch, step), for each target; torchrun restarts the round."""
    name = job.fresh("worker_kills")
    start = time.monotonic()
    agent = Agent(torchrun_cmd(2, job.args(name, "--checkpoint-interval", "1"), restarts=len(targets)), job.env(name))
    recovery, after = [], 0.0
    for epoch, step, rank in targets:
        t, _ = agent.wait_for(step_line(epoch, step, epochs), timeout, after)
        os.kill(_worker_with_rank(agent, rank), signal.SIGKILL)
        killed_at = time.monotonic()
        back, _ = agent.wait_for(RESUMED.pattern, timeout, killed_at)
        recovery.append(back - killed_at)
        after = back
    if agent.wait(timeout) != 0:
        raise RuntimeError(f"training did not complete after the kills:\n{agent.output}")
    return job.outcome(name, "worker SIGKILL, torchrun --max-restarts", len(targets), len(targets), recovery,
                       time.monotonic() - start, clean_wall)


def _worker_with_rank(agent: Agent, rank: int) -> int:
    workers = workers_by_rank(agent.proc.pid)
    if rank not in workers:
        raise RuntimeError(f"no worker with RANK={rank}")
    return workers[rank]


def preemption(job: Job, epoch: int, step: int, epochs: int, clean_wall: float, timeout: float = 600) -> Outcome:
    """SIGTERM to every worker (as Slurm does before preempting), then the same command with --resume."""
    name = job.fresh("preemption")
    start = time.monotonic()
    agent = Agent(torchrun_cmd(2, job.args(name)), job.env(name))
    agent.wait_for(step_line(epoch, step, epochs), timeout)
    agent.signal_workers(signal.SIGTERM)
    signalled = time.monotonic()
    agent.wait(timeout)
    again = Agent(torchrun_cmd(2, job.args(name, "--resume")), job.env(name))
    back, _ = again.wait_for(RESUMED.pattern, timeout)
    if again.wait(timeout) != 0:
        raise RuntimeError(f"the resumed run failed:\n{again.output}")
    return job.outcome(name, "SIGTERM to all workers, then --resume", 1, 1, [back - signalled],
                       time.monotonic() - start, clean_wall)


def elastic(job: Job, kill_at: tuple[int, int], epochs: int, clean_wall: float, timeout: float = 600,
            join_after_steps: int = 2) -> tuple[Outcome, str]:
    """Two single-worker agents; one node dies (2 -> 1), later a new node joins (1 -> 2).

    Returns the outcome (its recovery_s: kill -> first step at world size 1, join -> first step at
    world size 2) and every agent's output.
    """
    name = job.fresh("elastic")
    env = dict(job.env(name), **{SHARED_STORE_OFF: "1"})
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = torchrun_cmd(1, job.args(name, "--resume", "--checkpoint-interval", "1", "--threads", "1"), restarts=3,
                       endpoint=endpoint)
    start = time.monotonic()
    first = Agent(cmd, env)
    time.sleep(1.0)  # the first agent binds the rendezvous endpoint and so hosts the job's store
    second = Agent(cmd, env)
    agents = [first, second]
    try:
        _wait_any(agents, step_line(*kill_at, epochs), timeout)
        second.kill_node()
        killed_at = time.monotonic()
        back, _ = first.wait_for(RESUMED.pattern, timeout, killed_at)
        for _ in range(join_after_steps):  # the lone worker is training: now a node joins
            back, _ = first.wait_for(r"epoch \d+/\d+ step \d+/", timeout, back + 1e-6)
        agents.append(Agent(cmd, env))
        joined_at = time.monotonic()
        rejoined, _ = _wait_any([first, agents[2]], RESUMED.pattern, timeout, joined_at)
        codes = [first.wait(timeout), agents[2].wait(timeout)]
    finally:
        for i, agent in enumerate(agents):
            agent.kill_node()
            (job.workdir / name / f"agent{i}.log").write_text(agent.output)
    outputs = "\n".join(f"----- agent {i}\n{a.output}" for i, a in enumerate(agents))
    if codes != [0, 0]:
        raise RuntimeError(f"elastic run failed with {codes}:\n{outputs}")
    world1 = first.find(RESUMED.pattern, killed_at)
    assert world1 is not None
    outcome = job.outcome(name, "node lost (2 -> 1), node joined (1 -> 2)", 2, 2,
                          [world1[0] - killed_at, rejoined - joined_at], time.monotonic() - start, clean_wall)
    return outcome, outputs


def _wait_any(agents: list[Agent], pattern: str, timeout: float, after: float = 0.0) -> tuple[float, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for agent in agents:
            found = agent.find(pattern, after)
            if found is not None:
                return found
        time.sleep(0.02)
    raise TimeoutError(f"no agent printed {pattern!r} within {timeout} s")

"""The slurm method against a real Slurm: controller + two slurmd nodes n1, n2 on this host, fake GPUs.

scripts/slurm_local_cluster.sh installs Debian's Slurm and starts the cluster. The tests skip only
where the daemons cannot run at all (not root); anywhere else a failure to start fails them.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    SHORT_RUN,
    SMALL_RUN,
    assert_matches_reference,
    assert_same_tensors,
    child_env,
    finish,
    load_checkpoint,
    python_cmd,
    start,
)

from imagenet_elastic.checkpoint.store import CheckpointLock
from imagenet_elastic.report.samplelog import ENV_VAR, coverage

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # every test here starts processes on the one local cluster

CLUSTER_SCRIPT = REPO / "scripts" / "slurm_local_cluster.sh"


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("slurmctld/slurmd/munged must be started as root (scripts/slurm_local_cluster.sh)")
    started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, f"the local Slurm cluster did not start:\n{started.stderr[-3000:]}"
    conf = started.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    return child_env(SLURM_CONF=conf)


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(slurm_env):
    """A test that timed out kills its srun client, not its job: cancel what is left so the next test's jobs
    are not queued behind it (one hang failed every later test once)."""
    yield
    subprocess.run(["scancel", "--user", "root", "--full"], env=slurm_env, capture_output=True, timeout=30)


def queued_jobs(env: dict[str, str]) -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True,
                          timeout=30).stdout.split("\n")[:-1]


def test_a_cluster_started_again_after_the_machine_stopped_has_no_phantom_jobs(slurm_env, tmp_path):
    # a machine stopped in the middle of a test: the controller saved a RUNNING job that holds every GPU
    job = subprocess.run(["sbatch", "--parsable", "-N2", "--gres=gpu:2", f"--output={tmp_path / 'job.out'}",
                          "--wrap", "sleep 600.5"], env=slurm_env, capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    wait_until(lambda: job_field(job.stdout.strip(), "JobState", slurm_env) == "RUNNING", 60, "the job to run")
    subprocess.run(["scontrol", "shutdown", "slurmctld"], env=slurm_env, capture_output=True, timeout=30)
    subprocess.run(["pkill", "-KILL", "-f", "slurmd -f " + slurm_env["SLURM_CONF"]], timeout=30)
    subprocess.run(["pkill", "-KILL", "-f", "^slurmstepd"], timeout=30)
    subprocess.run(["pkill", "-KILL", "-f", "sleep 600.5"], timeout=30)

    started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stderr[-3000:]
    assert queued_jobs(slurm_env) == []
    gpus = subprocess.run(["srun", "-N2", "--gres=gpu:2", "--immediate=30", "printenv", "CUDA_VISIBLE_DEVICES"],
                          env=slurm_env, capture_output=True, text=True, timeout=60)
    assert gpus.stdout.split() == ["0,1", "0,1"], gpus.stdout + gpus.stderr


def srun(env: dict[str, str], layout: list[str], args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", "--kill-on-bad-exit=1", *layout, *python_cmd(*args, "--dist-init-method", "slurm")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_srun_two_nodes_one_task_each_finds_master_in_hostlist(slurm_env, image_folder, tmp_path, reference_world2):
    # both "nodes" share this host's 2 cores: pin one thread per rank, like the reference
    result = srun(slurm_env, ["-N2", "--ntasks-per-node=1"],
                  [str(image_folder), *SHORT_RUN, "--threads", "1", "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "srun, gloo, rendezvous n1:" in result.stdout  # MASTER_ADDR = first host of n[1-2]
    assert result.stdout.count("global batch") == 1
    assert_matches_reference(tmp_path, reference_world2)


def test_srun_one_node_two_tasks(slurm_env, image_folder, tmp_path, reference_world2):
    result = srun(slurm_env, ["-N1", "--ntasks-per-node=2"],
                  [str(image_folder), *SHORT_RUN, "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 (2 per node)" in result.stdout
    assert_matches_reference(tmp_path, reference_world2)


def test_srun_one_task_per_node_spawns_one_process_per_gpu(slurm_env, image_folder, tmp_path):
    result = srun(slurm_env, ["-N2", "--ntasks-per-node=1", "--gres=gpu:2"],
                  [str(image_folder), *SHORT_RUN, "--batch-size", "4", "--nproc-per-node", "2",
                   "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 (2 per node)" in result.stdout and "16 = 4 processes x 4" in result.stdout
    assert result.stdout.count("global batch") == 1
    assert load_checkpoint(tmp_path / "last.pt")["world_size"] == 4


def sbatch(env: dict[str, str], script: str, options: list[str], args: list[str], log) -> str:
    """Submit an example script, wait for it, and return the job's output (the test fails unless it completed).

    Polls scontrol rather than `sbatch --wait`, which looks after 2 s, 10 s and then every 32 s, so a
    job of 12 s would cost 42 (see scripts/slurm_local_cluster.sh).
    """
    submitted = subprocess.run(["sbatch", "--parsable", *options, f"--output={log}", str(REPO / "scripts" / script),
                                *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    state = wait_until(lambda: (s := job_field(job, "JobState", env)) not in ("", "PENDING", "RUNNING", "COMPLETING")
                       and s, 300, f"job {job} to end")
    output = log.read_text() if log.exists() else ""
    assert state == "COMPLETED" and job_field(job, "ExitCode", env) == "0:0", f"job {job}: {state}\n{output}"
    return output


def test_sbatch_example_script_runs_to_completion(slurm_env, image_folder, tmp_path, reference_world2):
    # the example asks for 2 nodes x 4 GPUs x 8 CPUs; the test cluster has 2 fake GPUs and 2 CPUs a node
    output = sbatch(slurm_env, "sbatch_task_per_gpu.sh",
                    ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-task=1", "--cpus-per-task=1"],
                    [str(tmp_path / "ckpt"), str(image_folder), *SHORT_RUN, "--threads", "1"], tmp_path / "job.out")
    assert "epoch 1/1: train loss" in output
    assert_matches_reference(tmp_path / "ckpt", reference_world2)


def test_env_method_under_srun_without_torchrun_is_refused(slurm_env, image_folder, tmp_path):
    result = subprocess.run(["srun", "-N1", "--ntasks-per-node=2", *python_cmd(str(image_folder))],
                            cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "pass --dist-init-method slurm" in result.stderr and "Traceback" not in result.stderr



def test_sbatch_srun_torchrun_example_uses_torchrun_variables(slurm_env, image_folder, tmp_path, reference_world2):
    env = {**slurm_env, "NPROC_PER_NODE": "1", "RDZV_PORT": "29457"}
    output = sbatch(env, "sbatch_srun_torchrun.sh",
                    ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gres=gpu:1"],
                    [str(tmp_path / "ckpt"), str(image_folder), *SHORT_RUN, "--threads", "1"], tmp_path / "job.out")
    assert "torchrun, gloo, rendezvous" in output  # torchrun's variables won over SLURM_*
    assert_matches_reference(tmp_path / "ckpt", reference_world2)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def submit_one_task(env: dict, log: Path, *args: str) -> str:
    """scripts/sbatch_task_per_gpu.sh on one task of one node, its output in `log`; returns the job id."""
    script = str(REPO / "scripts" / "sbatch_task_per_gpu.sh")
    submitted = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-task=1",
                                "--cpus-per-task=1", f"--output={log}", script, *args],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def job_field(job: str, field: str, env: dict[str, str]) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    match = re.search(rf"\b{field}=(\S+)", shown)
    return match.group(1) if match else ""


def test_usr1_before_the_time_limit_checkpoints_requeues_and_the_requeued_job_continues_exactly(
        slurm_env, image_folder, tmp_path):
    """What `#SBATCH --signal=USR1@120` does near the time limit, sent now with `scancel --signal=USR1`."""
    args = [str(image_folder), *SMALL_RUN, "--epochs", "6", "--threads", "1"]  # long enough for scancel to land
    clean = start(python_cmd(*args, "--checkpoints-path", str(tmp_path / "clean")))  # beside the job
    log = tmp_path / "job.out"
    env = {**slurm_env, ENV_VAR: str(tmp_path / "samples")}
    job = submit_one_task(env, log, str(tmp_path / "ckpt"), *args)
    try:
        wait_until(lambda: log.exists() and "epoch 2/6 step 3/" in log.read_text(), 120, "epoch 2 step 3")
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True, timeout=30)
        wait_until(lambda: job_field(job, "JobState", slurm_env) == "COMPLETED", 180, "the requeued job to finish")
    finally:
        subprocess.run(["scancel", job], env=slurm_env, timeout=30)
    finished = finish(clean)
    assert finished.returncode == 0, finished.stderr
    output = log.read_text()  # --open-mode=append (in the script): both runs' output
    assert job_field(job, "Restarts", slurm_env) == "1"
    assert f"requeued Slurm job {job}" in output and "SIGUSR1 came after step" in output
    assert re.search(r"resuming from .*: \d epochs? done", output), output  # mid-epoch or at an epoch's end
    assert "epoch 6/6: train loss" in output
    assert_same_tensors(load_checkpoint(tmp_path / "ckpt" / "last.pt")["model"],
                        load_checkpoint(tmp_path / "clean" / "last.pt")["model"])
    report = coverage(str(tmp_path / "samples"), 96, 8)
    assert (report.samples_lost, report.samples_repeated, report.steps_redone) == (0, 0, 0)


def test_usr1_during_start_up_stops_at_once_requeues_and_the_requeued_job_trains(slurm_env, image_folder, tmp_path):
    """The signal while rank 0 still waits for a checkpoints folder another run holds (a start-up that outlasts a
    grace period): no step to wait for, so the rank stops at once and requeues the job (launch/preemption.py)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    lock = CheckpointLock(str(folder))
    lock.acquire(0, lambda _holder: None)
    log = tmp_path / "job.out"
    job = submit_one_task(slurm_env, log, str(folder), str(image_folder), *SMALL_RUN, "--epochs", "1", "--threads", "1")
    try:
        wait_until(lambda: log.exists() and "is locked by" in log.read_text(), 120, "rank 0 to wait for the folder")
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True, timeout=30)
        wait_until(lambda: "requeued Slurm job" in log.read_text(), 30, "the requeue, at once")
        lock.release()  # the requeued job finds the folder free
        wait_until(lambda: job_field(job, "JobState", slurm_env) == "COMPLETED", 180, "the requeued job to finish")
    finally:
        lock.release()
        subprocess.run(["scancel", job], env=slurm_env, timeout=30)
    output = log.read_text()  # --open-mode=append (in the script): both runs' output
    assert job_field(job, "Restarts", slurm_env) == "1", output
    assert "SIGUSR1: stopped before training began" in output and f"requeued Slurm job {job}" in output, output
    assert "Traceback" not in output and "epoch 1/1: train loss" in output, output

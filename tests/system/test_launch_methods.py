"""Every launcher started for real: spawn, torchrun (single node, two agents, legacy launch), mpirun."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import fault_injection as fi
import inprocess
import pytest
from conftest import (
    REPO,
    SHORT_RUN,
    SMALL_RUN,
    assert_matches_reference,
    assert_row_describes,
    child_env,
    evaluate_checkpoint,
    make_image_folder,
    python_cmd,
    run,
)

from imagenet_elastic.data.sampler import BatchPlan, TrainBatchSampler
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.report.metrics import read as read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess,  # every test here starts several processes
              pytest.mark.usefixtures("warm_ranks")]  # the ranks torchrun starts: forks of the warm python


def run_together(commands: list[tuple[list[str], dict]], timeout: float = 240) -> tuple[list[int], list[str]]:
    """Start every (command, env) at once, as the nodes of one job; return exit codes and outputs.
    A node that hangs is killed with its workers, and the test fails showing what every node printed."""
    nodes = [fi.Agent(cmd, env) for cmd, env in commands]
    deadline = time.monotonic() + timeout
    try:
        codes = [node.wait(max(1.0, deadline - time.monotonic())) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill_node()
        raise AssertionError("a node hung; what each printed:\n" + "\n----\n".join(n.output for n in nodes)) from None
    return codes, [node.output for node in nodes]


def test_spawn_two_processes_matches_torchrun(image_folder, tmp_path, reference_world2, warm_python):
    """The parent is a fork of the warm python; the ranks, new interpreters (spawn)."""
    result = run(python_cmd(str(image_folder), *SHORT_RUN, "--checkpoints-path", str(tmp_path),
                            "--dist-init-method", "spawn", "--nproc-per-node", "2", python=warm_python))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("global batch") == 1
    assert_matches_reference(tmp_path, reference_world2)
    # the epoch's metrics row describes the checkpoint (rank 0's BatchNorm statistics, validated on every rank)
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert_row_describes(row, evaluate_checkpoint(image_folder, tmp_path / "last.pt", 1, tmp_path / "eval"))


def test_spawn_rank_1_failure_stops_every_process(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=4, train_per_class=8, val_per_class=1)
    index = scan_image_folder(str(data / "train"), "train")
    sampler = TrainBatchSampler(len(index), BatchPlan(global_batch=16, world_size=2, micro_batch=8), rank=1, seed=0)
    _, victim = next(iter(sampler))[0]  # the first image rank 1 loads
    bad = index.path(victim)
    with open(bad, "wb") as f:
        f.write(b"not a jpeg at all")
    proc = subprocess.Popen(python_cmd(str(data), *SMALL_RUN, "--workers", "0", "--checkpoints-path",
                                       str(tmp_path / "ck"), "--dist-init-method", "spawn", "--nproc-per-node", "2"),
                            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert f"[rank 1] cannot decode image file {bad}" in stderr
    assert "Traceback" not in stderr
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the whole process group is gone, none left in a collective
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("processes of the failed spawn run are still alive")


def test_a_spawned_ranks_error_about_a_config_files_key_is_one_line_naming_the_file(image_folder, tmp_path,
                                                                                     warm_python):
    """The rank entry crosses spawn's pickle with the file's name, and the parent adds nothing (torch's own
    "Terminating process" warning included) once a rank has said why it stopped."""
    path = tmp_path / "run.yaml"
    path.write_text("model: nosuch\ndist-init-method: spawn\nnproc-per-node: 2\n")
    result = run(python_cmd(str(image_folder), "--config", str(path), "--workers", "0", "--checkpoints-path",
                            str(tmp_path / "ck"), python=warm_python))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"imagenet-elastic: error: config file {path} sets model: --model 'nosuch'"), line


def test_legacy_torch_distributed_launch_local_rank_argument(image_folder, tmp_path, reference_world2):
    """`python -m torch.distributed.launch` passes --local-rank=N; the trainer accepts it."""
    result = run([sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node=2", "--master-port=29731",
                  "-m", "imagenet_elastic", str(image_folder), *SHORT_RUN, "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert_matches_reference(tmp_path, reference_world2)


def test_two_torchrun_agents_form_one_job_through_c10d_rendezvous(image_folder, tmp_path, reference_world2):
    port = fi.free_port()
    codes, outputs = run_together([
        ([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}",
          "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-agents",
          # both "nodes" share this host's 2 cores: one thread each, as the reference's ranks had
          "-m", "imagenet_elastic", str(image_folder), *SHORT_RUN, "--threads", "1", "--dist-timeout", "60",
          "--checkpoints-path", str(tmp_path)], child_env(LOGLEVEL="INFO")) for n in range(2)])
    assert codes == [0, 0], "\n".join(outputs)
    assert sum(o.count("global batch") for o in outputs) == 1  # one rank 0 across both agents
    assert_matches_reference(tmp_path, reference_world2)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI is installed by scripts/slurm_local_cluster.sh")
def test_mpirun_example_script_two_ranks_matches_torchrun(image_folder, tmp_path, reference_world2):
    env = child_env(CHECKPOINTS=str(tmp_path), MASTER_PORT=str(fi.free_port()))
    result = subprocess.run(["bash", str(REPO / "scripts" / "mpirun_example.sh"), "2", str(image_folder), *SHORT_RUN],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("global batch") == 1 and "mpirun, gloo, rendezvous 127.0.0.1:" in result.stdout
    assert_matches_reference(tmp_path, reference_world2)


def test_multinode_torchrun_script_with_node_level_variables(image_folder, tmp_path, reference_world2):
    """Two "containers" on this host, each given the cluster's node-level RANK/WORLD_SIZE/MASTER_*."""
    port = fi.free_port()
    script = ["bash", str(REPO / "scripts" / "torchrun_multinode.sh"), str(image_folder), *SHORT_RUN, "--threads", "1"]
    codes, outputs = run_together([
        (script, child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(node), WORLD_SIZE="2",
                           NPROC_PER_NODE="1", CHECKPOINTS=str(tmp_path))) for node in range(2)])
    assert codes == [0, 0], "\n".join(outputs)
    assert "2 (1 per node)" in outputs[0]
    assert_matches_reference(tmp_path, reference_world2)


def test_env_method_under_mpirun_without_torchrun_variables_is_refused(image_folder, tmp_path, monkeypatch):
    for name in set(os.environ) - set(child_env()):
        monkeypatch.delenv(name)  # no launcher's variables in this process ...
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # ... but mpirun's
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    result = inprocess.command([str(image_folder), "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 2
    assert "pass --dist-init-method mpi" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.mostly_waiting  # one process, for --dist-timeout
def test_missing_peer_fails_after_dist_timeout_with_one_clear_line(image_folder, tmp_path):
    """Rank 1 of 2 with nobody at MASTER_ADDR:MASTER_PORT: a named error after --dist-timeout, not a hang."""
    port = fi.free_port()  # nothing listens here once the socket is closed
    env = child_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    started = time.monotonic()
    result = subprocess.run(python_cmd(str(image_folder), *SHORT_RUN, "--dist-timeout", "3", "--checkpoints-path",
                                       str(tmp_path)), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    ours = [line for line in result.stderr.splitlines() if line.startswith("imagenet-elastic: error:")]
    assert len(ours) == 1, result.stderr
    assert f"[rank 1] gave up connecting at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in ours[0]
    assert "--dist-timeout" in ours[0] and "Traceback" not in result.stderr
    assert time.monotonic() - started < 60

"""Two "nodes" on this host (two torchrun agents, or two processes started with the job's variables
as a scheduler starts them) that were given different data, settings or checkpoints folders: every
node's log says what differs, every rank exits 2 before any work, and nothing is written. The four
jobs run side by side: each refusal is mostly process start-up."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

import fault_injection as fi
import pytest
from conftest import SHORT_RUN, child_env, make_image_folder
from makers import run_pack

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PREFIX = "imagenet-elastic: error: "


def two_nodes(python: str, data: list[Path], checkpoints: list[Path], extra: list[list[str]],
              torchrun: bool) -> list[fi.Agent]:
    """Node n trains on data[n] into checkpoints[n] with extra[n] appended to the command line, as rank
    n: under a torchrun agent each (static rendezvous, so that node n holds rank n), or started
    directly with the job's variables, as a scheduler starts one task per node. `python`: the interpreter of the
    agents and the ranks (the test run's warm one: forks that have imported torch)."""
    port = fi.free_port()
    nodes = []
    for n in range(2):
        train = ["-m", "imagenet_elastic", str(data[n]), *SHORT_RUN, "--threads", "1", "--dist-timeout", "60",
                 "--checkpoints-path", str(checkpoints[n]), *extra[n]]
        if torchrun:
            nodes.append(fi.Agent([python, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                   f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}", *train],
                                  child_env(PYTHON_EXEC=python)))
        else:
            nodes.append(fi.Agent([python, *train], child_env(
                RANK=str(n), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))))
    return nodes


def wait_all(jobs: dict[str, list[fi.Agent]], timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    for agents in jobs.values():
        for agent in agents:
            try:
                agent.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for each in (a for nodes in jobs.values() for a in nodes):
                    each.kill_node()
                raise AssertionError("a node hung:\n" + "\n----\n".join(a.output for a in agents)) from None
            agent._reader.join(10)


def our_errors(agent: fi.Agent) -> list[str]:
    return [line.strip() for line in agent.output.splitlines() if line.startswith(PREFIX)]


def assert_refused(agents: list[fi.Agent], *expected: str) -> str:
    """Both nodes failed, each log has our one line (the same text), every rank exited 2, no traceback."""
    outputs = "\n----\n".join(a.output for a in agents)
    assert [a.proc.returncode != 0 for a in agents] == [True, True], outputs
    lines = [our_errors(a) for a in agents]
    assert [len(found) for found in lines] == [1, 1], outputs
    rank0, rank1 = lines[0][0], lines[1][0]
    assert rank1 == rank0.replace(PREFIX, PREFIX + "[rank 1] "), outputs
    for text in expected:
        assert text in rank0, rank0
    # torchrun's agent raises ChildFailedError with a traceback of its own; the workers print none
    assert "]: Traceback" not in outputs and outputs.count("Traceback") == outputs.count("ChildFailedError:")
    for agent in agents:  # our exit code (in torchrun's summary of its failed worker), not a crash
        assert "exitcode  : 2" in agent.output if "torch.distributed.run" in agent.proc.args else \
            agent.proc.returncode == 2, agent.output
    return rank0


def assert_nothing_written(folder: Path) -> None:
    assert sorted(os.listdir(folder)) == [".lock"]
    fd = os.open(folder / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    finally:
        os.close(fd)


def test_nodes_with_different_data_settings_or_checkpoints_folders_are_refused_at_start(warm_python, tmp_path,
                                                                                        image_folder, one_epoch_run):
    node_a = make_image_folder(tmp_path / "node_a", classes=2, train_per_class=16, val_per_class=2)
    missing, moved = tmp_path / "missing", tmp_path / "moved"
    for copy in (missing, moved):
        shutil.copytree(node_a, copy)
    (missing / "train" / "class_001" / "train_001_00003.jpg").unlink()
    (moved / "train" / "class_000" / "train_000_00005.jpg").rename(moved / "train" / "class_001" / "moved.jpg")
    packs = [tmp_path / "pack_a", tmp_path / "pack_missing"]  # each node's pack of its own copy
    for folder, pack in zip((node_a, missing), packs):
        run_pack(str(folder), str(pack), "--shard-size", "16")
    ck = {name: [tmp_path / f"{name}_ck", tmp_path / f"{name}_ck"] for name in ("missing", "moved", "settings",
                                                                                 "packs")}
    ck["folders"] = [tmp_path / "folders_ck_a", tmp_path / "folders_ck_b"]
    val_missing = tmp_path / "val_missing"  # --evaluate: the checkpoint's data with a validation image less
    shutil.copytree(image_folder, val_missing)
    (val_missing / "val" / "class_002" / "val_002_00001.jpg").unlink()
    scored = ["--evaluate", "--resume", str(one_epoch_run / "last.pt")]
    jobs = {
        "missing": two_nodes(warm_python, [node_a, missing], ck["missing"], [[], []], torchrun=True),
        "folders": two_nodes(warm_python, [node_a, node_a], ck["folders"], [[], []], torchrun=True),
        "moved": two_nodes(warm_python, [node_a, moved], ck["moved"], [[], []], torchrun=False),
        "settings": two_nodes(warm_python, [node_a, node_a], ck["settings"], [[], ["--seed", "7"]], torchrun=False),
        "packs": two_nodes(warm_python, packs, ck["packs"], [[], []], torchrun=False),
        "evaluate": two_nodes(warm_python, [image_folder, val_missing], [tmp_path / "evaluate_ck"] * 2,
                              [scored, scored], torchrun=False),
    }
    wait_all(jobs)

    said = assert_refused(jobs["missing"], "train file lists differ: rank 0 (", "has 32 images in 2 classes",
                          "rank 1 (", ") 31 in 2;", "image #19 is 'class_001/train_001_00003.jpg' on rank 0 "
                          "but 'class_001/train_001_00004.jpg' on rank 1")
    assert "Node-local copies of the data must be identical" in said
    assert_refused(jobs["moved"], "train file lists differ", "32 images in 2 classes", ") 32 in 2;",
                   "image #5 is 'class_000/train_000_00005.jpg' on rank 0 but 'class_000/train_000_00006.jpg' "
                   "on rank 1")
    assert_refused(jobs["packs"], "train file lists differ", "32 images in 2 classes", ") 31 in 2;",
                   "image #19 is 'shard-000001.tar:00000019_train_001_00003.jpg' on rank 0 but "
                   "'shard-000001.tar:00000019_train_001_00004.jpg' on rank 1")
    assert_refused(jobs["settings"], "ranks were started with different settings",
                   "--seed is 0 on rank 0 but 7 on rank 1")
    assert_refused(jobs["folders"], "the checkpoints folder is not shared: rank 1 (",
                   "does not see the lock that rank 0 (", f"holds in {ck['folders'][0]} "
                   f"(it looks in {ck['folders'][1]})", "starts over from nothing")
    assert_refused(jobs["evaluate"], f"validation set {image_folder / 'val'} differs between ranks: rank 0 has 35 "
                   "images in 4 classes, rank 1 34 in 4", "image #19 is 'class_002/val_002_00001.jpg' on rank 0 but "
                   "'class_002/val_002_00002.jpg' on rank 1")
    assert not (tmp_path / "evaluate_ck").exists()
    for folders in ck.values():
        for folder in set(folders):
            if (folder / ".lock").exists():
                assert_nothing_written(folder)
            else:  # a rank other than 0 only checks that it could write there
                assert os.listdir(folder) == []

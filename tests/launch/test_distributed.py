"""This process's device and thread policy, decided before any process group exists."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from conftest import assert_names

from imagenet_elastic.errors import RendezvousError, UserError
from imagenet_elastic.launch import distributed
from imagenet_elastic.launch.distributed import (
    DistEnv,
    default_threads,
    group_options,
    select_device,
    visible_gpu_count,
)


def test_default_threads_divides_cores_by_local_processes(monkeypatch):
    monkeypatch.setattr(distributed, "available_cores", lambda: 16)
    assert default_threads(1) == 16
    assert default_threads(4) == 4
    assert default_threads(3) == 5
    assert default_threads(0) == 16


def test_default_threads_is_at_least_one(monkeypatch):
    monkeypatch.setattr(distributed, "available_cores", lambda: 4)
    assert default_threads(8) == 1
    assert default_threads(1000) == 1


# ----------------------------------------------------------------------------- visible_gpu_count, select_device

@pytest.mark.parametrize(("visible", "expected"), [
    ("0,1", 2), ("3", 1), ("0, 1, 2", 3), ("GPU-1a2b,GPU-3c4d", 2), ("", 0), ("-1", 0), (" ", 0),
])
def test_visible_gpu_count_reads_cuda_visible_devices(monkeypatch, visible, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 99)
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": visible}) == expected


@pytest.mark.parametrize("count", [0, 3])
def test_visible_gpu_count_without_variable_asks_cuda(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert visible_gpu_count({}) == count


def test_select_device_cpu_is_cpu_even_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device("cpu", DistEnv()) == torch.device("cpu")


def test_select_device_auto_without_cuda_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto", DistEnv()) == torch.device("cpu")


def test_select_device_cuda_without_cuda_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda.*no CUDA device"):
        select_device("cuda", DistEnv())


def fake_gpus(monkeypatch, count: int) -> list[int]:
    """A machine with `count` CUDA devices, as far as select_device can tell; returns the devices set."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_srun_tasks_that_each_see_their_own_gpu_take_device_0(monkeypatch):
    chosen = fake_gpus(monkeypatch, 1)  # --gpus-per-task=1: each task sees only its GPU
    env = DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, launched=True, launcher="srun")
    assert select_device("auto", env) == torch.device("cuda", 0) and chosen == [0]


def test_srun_tasks_that_share_the_nodes_gpus_beyond_their_number_are_refused(monkeypatch):
    fake_gpus(monkeypatch, 4)  # --ntasks-per-node=8 --gres=gpu:4: every task sees the same 4
    env = DistEnv(rank=5, world_size=16, local_rank=5, local_world_size=8, launched=True, launcher="srun")
    with pytest.raises(UserError) as caught:
        select_device("auto", env)
    assert_names(str(caught.value), "8 Slurm tasks per node", "4 GPUs", "--gpus-per-task=1")


def test_more_local_processes_than_gpus_under_other_launchers_are_refused(monkeypatch):
    fake_gpus(monkeypatch, 1)
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, launched=True, launcher="torchrun")
    with pytest.raises(UserError, match=r"^2 processes per node but only 1 CUDA device"):
        select_device("auto", env)


def test_a_cuda_rank_joins_with_nccl_bound_to_its_device_and_a_cpu_rank_with_gloo():
    assert group_options(torch.device("cuda", 3)) == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    assert group_options(torch.device("cpu")) == {"backend": "gloo"}


def test_a_master_port_in_use_where_rank_0_hosts_the_store_is_said_at_once_naming_it():
    """It said "gave up waiting for the other ranks ... after 10 s" though it had failed at once."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = DistEnv(master_port=port, launched=True, launcher="torchrun")
        began = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            distributed.init_process_group(env, torch.device("cpu"), 10.0)
    assert time.monotonic() - began < 5
    assert_names(str(info.value), f"MASTER_PORT={port}")
    assert "gave up" not in str(info.value)

"""Rank discovery from launcher variables and the per-process thread policy (no process group)."""

from __future__ import annotations

import pytest

from imagenet_elastic import distributed
from imagenet_elastic.distributed import DistEnv, default_threads
from imagenet_elastic.errors import UserError
from imagenet_elastic.launchers import env_from_torchrun, resolve_launch

TORCHRUN_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0.cluster",
    "MASTER_PORT": "29512",
}


def test_no_launcher_variables_means_one_plain_process():
    env = env_from_torchrun({})
    assert env == DistEnv()
    assert env.launched is False
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert env.is_main


def test_unrelated_variables_do_not_count_as_a_launcher():
    assert env_from_torchrun({"HOME": "/root", "OMP_NUM_THREADS": "1"}).launched is False


def test_full_torchrun_environment_is_read():
    env = env_from_torchrun(TORCHRUN_ENV)
    assert env == DistEnv(rank=3, world_size=8, local_rank=1, local_world_size=2,
                          master_addr="node0.cluster", master_port=29512, restart_count=0, launched=True,
                          launcher="torchrun")
    assert not env.is_main


def test_local_world_size_defaults_to_world_size():
    environ = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_WORLD_SIZE"}
    assert env_from_torchrun(environ).local_world_size == 8


def test_legacy_local_rank_argument_is_used_when_local_rank_variable_is_absent():
    environ = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    env = env_from_torchrun(environ, local_rank_arg=5)
    assert env.local_rank == 5
    assert env.launched


def test_local_rank_variable_wins_over_the_legacy_argument():
    assert env_from_torchrun(TORCHRUN_ENV, local_rank_arg=5).local_rank == 1


def test_missing_local_rank_without_legacy_argument_names_local_rank():
    environ = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    with pytest.raises(UserError, match="LOCAL_RANK") as caught:
        env_from_torchrun(environ)
    assert "torchrun" in str(caught.value)


def test_missing_variables_are_named_together_with_torchrun():
    with pytest.raises(UserError) as caught:
        env_from_torchrun({"RANK": "0", "LOCAL_RANK": "0"})
    message = str(caught.value)
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert name in message
    assert "found RANK, LOCAL_RANK" in message
    assert "torchrun" in message


def test_legacy_argument_alone_reports_the_missing_variables():
    with pytest.raises(UserError) as caught:
        env_from_torchrun({}, local_rank_arg=0)
    message = str(caught.value)
    assert "--local-rank" in message
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert name in message
    assert "torchrun" in message


def test_non_integer_rank_names_rank():
    with pytest.raises(UserError, match=r"RANK='zero' is not an integer"):
        env_from_torchrun({**TORCHRUN_ENV, "RANK": "zero"})


def test_non_integer_master_port_names_master_port():
    with pytest.raises(UserError, match="MASTER_PORT"):
        env_from_torchrun({**TORCHRUN_ENV, "MASTER_PORT": "http"})


def test_rank_outside_world_size_is_refused():
    with pytest.raises(UserError, match="RANK=8 is outside WORLD_SIZE=8"):
        env_from_torchrun({**TORCHRUN_ENV, "RANK": "8"})


def test_torchelastic_restart_count_is_parsed():
    assert env_from_torchrun({**TORCHRUN_ENV, "TORCHELASTIC_RESTART_COUNT": "2"}).restart_count == 2
    assert env_from_torchrun({**TORCHRUN_ENV, "TORCHELASTIC_RESTART_COUNT": ""}).restart_count == 0
    assert env_from_torchrun(TORCHRUN_ENV).restart_count == 0


def test_resolve_launch_refuses_unknown_methods():
    assert resolve_launch("env", {}).env == DistEnv()
    with pytest.raises(UserError, match="--dist-init-method 'tcp' is not supported"):
        resolve_launch("tcp", {})


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


def test_default_threads_uses_the_real_core_count():
    cores = distributed.available_cores()
    assert cores >= 1
    assert default_threads(1) == cores

"""Launcher rules as pure functions of the environment: torchrun, Slurm, MPI, spawn, and choosing among them."""

from __future__ import annotations

import pytest
from conftest import assert_names, single_line

from imagenet_elastic.errors import UserError
from imagenet_elastic.launch.launchers import (
    DistEnv,
    LaunchPlan,
    env_from_mpi,
    env_from_slurm,
    env_from_torchrun,
    resolve_launch,
    slurm_master_port,
    slurm_procs_per_task,
    tasks_on_node,
)

# ----------------------------------------------------------------------------- env_from_torchrun

WORKER_ENV = {
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
    env = env_from_torchrun(WORKER_ENV)
    assert env == DistEnv(rank=3, world_size=8, local_rank=1, local_world_size=2,
                          master_addr="node0.cluster", master_port=29512, restart_count=0, launched=True,
                          launcher="torchrun")
    assert not env.is_main


def test_local_world_size_defaults_to_world_size():
    environ = {k: v for k, v in WORKER_ENV.items() if k != "LOCAL_WORLD_SIZE"}
    assert env_from_torchrun(environ).local_world_size == 8


def test_legacy_local_rank_argument_is_used_when_local_rank_variable_is_absent():
    environ = {k: v for k, v in WORKER_ENV.items() if k != "LOCAL_RANK"}
    env = env_from_torchrun(environ, local_rank_arg=0)
    assert env.local_rank == 0
    assert env.launched


def test_local_rank_variable_wins_over_the_legacy_argument():
    assert env_from_torchrun(WORKER_ENV, local_rank_arg=5).local_rank == 1


def test_missing_local_rank_without_legacy_argument_names_local_rank():
    environ = {k: v for k, v in WORKER_ENV.items() if k != "LOCAL_RANK"}
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
        env_from_torchrun({**WORKER_ENV, "RANK": "zero"})


def test_non_integer_master_port_names_master_port():
    with pytest.raises(UserError, match="MASTER_PORT"):
        env_from_torchrun({**WORKER_ENV, "MASTER_PORT": "http"})


def test_rank_outside_world_size_is_refused():
    with pytest.raises(UserError, match="RANK=8 is outside WORLD_SIZE=8"):
        env_from_torchrun({**WORKER_ENV, "RANK": "8"})


@pytest.mark.parametrize(("changes", "local_rank_arg", "culprit"), [
    ({"LOCAL_RANK": "2"}, None, ("LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2")),
    ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": None}, None, ("LOCAL_RANK=8", "WORLD_SIZE=8")),
    ({"LOCAL_RANK": None}, 2, ("--local-rank=2", "LOCAL_WORLD_SIZE=2")),  # torch.distributed.launch's argument
])
def test_local_rank_outside_local_world_size_is_refused_naming_both(changes, local_rank_arg, culprit):
    environ = {k: v for k, v in {**WORKER_ENV, **changes}.items() if v is not None}
    with pytest.raises(UserError) as caught:
        env_from_torchrun(environ, local_rank_arg)
    assert_names(single_line(str(caught.value)), *culprit)


def test_torchelastic_restart_count_is_parsed():
    assert env_from_torchrun({**WORKER_ENV, "TORCHELASTIC_RESTART_COUNT": "2"}).restart_count == 2
    assert env_from_torchrun({**WORKER_ENV, "TORCHELASTIC_RESTART_COUNT": ""}).restart_count == 0
    assert env_from_torchrun(WORKER_ENV).restart_count == 0


def test_resolve_launch_refuses_unknown_methods():
    assert resolve_launch("env", {}).env == DistEnv()
    with pytest.raises(UserError, match="--dist-init-method 'tcp' is not supported"):
        resolve_launch("tcp", {})


# ----------------------------------------------------------------------------- helpers

# srun --nodes=4 --ntasks-per-node=2: the second task on the third node (global rank 5 of 8).
SLURM_ENV = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu-a[01-03,07],gpu-b9",
    "SLURM_TASKS_PER_NODE": "2(x4)",
}

OMPI_ENV = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}

PMI_ENV = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}


def never_called(nodelist: str) -> str:
    raise AssertionError(f"scontrol fallback was called for {nodelist!r} although our parser handles it")


class RecordingFallback:
    """A stand-in for `scontrol show hostnames` that records what it was asked."""

    def __init__(self, answer: str = "from-scontrol") -> None:
        self.answer = answer
        self.calls: list[str] = []

    def __call__(self, nodelist: str) -> str:
        self.calls.append(nodelist)
        return self.answer


def slurm(**changes: str | None) -> dict[str, str]:
    """SLURM_ENV with some variables replaced; None removes one."""
    env = dict(SLURM_ENV)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


# ----------------------------------------------------------------------------- tasks_on_node

@pytest.mark.parametrize(("spec", "node_id", "expected"), [
    ("4", 0, 4),
    ("2(x3),1", 0, 2),
    ("2(x3),1", 2, 2),
    ("2(x3),1", 3, 1),
    ("1,3", 1, 3),
    ("3(x2),1(x2),2", 0, 3),
    ("3(x2),1(x2),2", 1, 3),
    ("3(x2),1(x2),2", 2, 1),
    ("3(x2),1(x2),2", 3, 1),
    ("3(x2),1(x2),2", 4, 2),
    ("16(x100)", 99, 16),
])
def test_tasks_on_node_expands_slurm_compressed_counts(spec, node_id, expected):
    assert tasks_on_node(spec, node_id) == expected


@pytest.mark.parametrize("spec", ["", "x", "2x3", "2(3)", "2(x)", "2(x3", "(x3)", "-1", "2;1", "2,,1", "two"])
def test_tasks_on_node_rejects_text_not_in_slurm_format(spec):
    with pytest.raises(UserError, match="SLURM_TASKS_PER_NODE.*not in Slurm's format"):
        tasks_on_node(spec, 0)


@pytest.mark.parametrize(("spec", "node_id"), [("2(x3),1", 4), ("2(x3),1", -1), ("4", 1), ("1(x2)", 2)])
def test_tasks_on_node_rejects_node_ids_outside_the_list(spec, node_id):
    with pytest.raises(UserError, match=f"SLURM_NODEID={node_id} is outside"):
        tasks_on_node(spec, node_id)


# ----------------------------------------------------------------------------- slurm_master_port

@pytest.mark.parametrize("job_id", [0, 1, 14999, 15000, 29999, 30000, 123456, 2**31 - 1, 10**12 + 7])
def test_slurm_master_port_follows_the_documented_formula_and_range(job_id):
    port = slurm_master_port(job_id)
    assert port == 15000 + job_id % 15000
    assert 15000 <= port < 30000
    assert port < 32768  # below Linux's ephemeral port range


@pytest.mark.parametrize("job_id", [0, 14998, 14999, 15000, 99999, 123456])
def test_slurm_master_port_differs_for_consecutive_jobs(job_id):
    assert slurm_master_port(job_id) != slurm_master_port(job_id + 1)


# ----------------------------------------------------------------------------- env_from_slurm

def test_env_from_slurm_reads_one_task_per_gpu_layout():
    env = env_from_slurm(SLURM_ENV, fallback=never_called)
    assert env == DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=2, master_addr="gpu-a01",
                          master_port=15000 + 123456 % 15000, restart_count=0, launched=True, launcher="srun")


def test_env_from_slurm_prefers_step_nodelist_over_job_nodelist():
    env = env_from_slurm(slurm(SLURM_STEP_NODELIST="step-n[5-6]"), fallback=never_called)
    assert env.master_addr == "step-n5"


def test_env_from_slurm_uses_job_nodelist_when_step_nodelist_is_empty():
    env = env_from_slurm(slurm(SLURM_STEP_NODELIST=""), fallback=never_called)
    assert env.master_addr == "gpu-a01"


def test_env_from_slurm_master_addr_and_port_from_environment_override_derived_values():
    env = env_from_slurm(slurm(MASTER_ADDR="10.0.0.9", MASTER_PORT="23456"), fallback=never_called)
    assert (env.master_addr, env.master_port) == ("10.0.0.9", 23456)


def test_env_from_slurm_explicit_master_port_argument_beats_environment():
    env = env_from_slurm(slurm(MASTER_PORT="23456"), master_port=17777, fallback=never_called)
    assert env.master_port == 17777


def test_env_from_slurm_non_integer_master_port_variable_is_a_user_error():
    with pytest.raises(UserError, match="MASTER_PORT='abc'"):
        env_from_slurm(slurm(MASTER_PORT="abc"), fallback=never_called)


@pytest.mark.parametrize(("changes", "expected"), [
    ({"SLURM_TASKS_PER_NODE": "2(x4)"}, 2),
    ({"SLURM_TASKS_PER_NODE": "4,4,3,1", "SLURM_NODEID": "2"}, 3),
    # the step's own layout wins
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_TASKS_PER_NODE": "4(x4)", "SLURM_LOCALID": "0"}, 1),
    ({"SLURM_STEP_TASKS_PER_NODE": "", "SLURM_TASKS_PER_NODE": "3(x4)"}, 3),
    ({"SLURM_TASKS_PER_NODE": None}, 8),  # no layout at all: every task is on one node
])
def test_env_from_slurm_local_world_size_comes_from_tasks_per_node(changes, expected):
    assert env_from_slurm(slurm(**changes), fallback=never_called).local_world_size == expected


@pytest.mark.parametrize(("changes", "culprit"), [
    ({"SLURM_LOCALID": "3", "SLURM_TASKS_PER_NODE": "2(x4)"}, ("SLURM_LOCALID=3", "SLURM_TASKS_PER_NODE", "2(x4)",
                                                              "2", "SLURM_NODEID=2")),
    ({"SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "4,4,2,1"}, ("SLURM_LOCALID=2", "SLURM_STEP_TASKS_PER_NODE",
                                                                      "4,4,2,1", "2", "SLURM_NODEID=2")),
    ({"SLURM_LOCALID": "8", "SLURM_TASKS_PER_NODE": None}, ("SLURM_LOCALID=8", "SLURM_NTASKS=8")),
])
def test_env_from_slurm_local_id_outside_the_node_tasks_is_refused_naming_both(changes, culprit):
    with pytest.raises(UserError) as caught:
        env_from_slurm(slurm(**changes), fallback=never_called)
    assert_names(single_line(str(caught.value)), *culprit)


def test_env_from_slurm_restart_count_from_slurm_restart_count():
    assert env_from_slurm(slurm(SLURM_RESTART_COUNT="2"), fallback=never_called).restart_count == 2


@pytest.mark.parametrize("missing", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
                                     "SLURM_JOB_ID"])
def test_env_from_slurm_missing_variable_names_all_looked_for_and_srun(missing):
    with pytest.raises(UserError) as info:
        env_from_slurm(slurm(**{missing: None}), fallback=never_called)
    message = str(info.value)
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID"):
        assert name in message
    assert f"but {missing} is not set" in message
    assert "srun" in message


def test_env_from_slurm_with_no_variables_at_all_names_them_and_srun():
    with pytest.raises(UserError, match=r"looked for SLURM_PROCID, .*SLURM_JOB_ID but .* are not set.*srun"):
        env_from_slurm({}, fallback=never_called)


def test_env_from_slurm_without_any_nodelist_names_both_variables_and_srun():
    with pytest.raises(UserError, match="SLURM_STEP_NODELIST and SLURM_JOB_NODELIST.*srun"):
        env_from_slurm(slurm(SLURM_JOB_NODELIST=None), fallback=never_called)


def test_env_from_slurm_does_not_call_scontrol_fallback_for_parsable_nodelist():
    fallback = RecordingFallback()
    env = env_from_slurm(SLURM_ENV, fallback=fallback)
    assert fallback.calls == []
    assert env.master_addr == "gpu-a01"


def test_env_from_slurm_calls_scontrol_fallback_only_when_our_parser_fails():
    fallback = RecordingFallback("node-from-scontrol")
    env = env_from_slurm(slurm(SLURM_JOB_NODELIST="gpu[01-"), fallback=fallback)
    assert fallback.calls == ["gpu[01-"]
    assert env.master_addr == "node-from-scontrol"


def test_env_from_slurm_skips_nodelist_and_fallback_when_master_addr_is_set():
    fallback = RecordingFallback()
    env = env_from_slurm(slurm(SLURM_JOB_NODELIST="gpu[01-", MASTER_ADDR="head"), fallback=fallback)
    assert fallback.calls == []
    assert env.master_addr == "head"


# ----------------------------------------------------------------------------- slurm_procs_per_task

@pytest.mark.parametrize(("environ", "nproc_per_node", "visible_gpus", "expected"), [
    ({"SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"}, 3, 2, 3),  # --nproc-per-node wins (ranks on CPU)
    ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "0"}, 2, 8, 2),  # ... even with several tasks
    ({"SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1"}, None, 2, 2),  # one task, 2 GPUs -> 2 ranks
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "0"}, None, 4, 4),
    ({"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "0"}, None, 2, 1),  # several tasks per node -> 1
    ({"SLURM_TASKS_PER_NODE": "1,2", "SLURM_NODEID": "1"}, None, 4, 1),
    ({"SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"}, None, 0, 1),  # no GPUs -> 1
    ({"SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"}, None, 1, 1),
    ({}, None, 4, 1),  # no layout known -> 1
])
def test_slurm_procs_per_task(environ, nproc_per_node, visible_gpus, expected):
    assert slurm_procs_per_task(environ, nproc_per_node, visible_gpus) == expected


def test_more_ranks_per_task_than_its_gpus_is_refused_when_training_on_gpus():
    environ = {"SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"}
    with pytest.raises(UserError) as caught:
        slurm_procs_per_task(environ, 3, 2, uses_gpus=True)
    assert_names(str(caught.value), "--nproc-per-node 3", "2 GPU", "--gres=gpu:3", "--nproc-per-node 2",
                 "--device cpu")
    assert slurm_procs_per_task(environ, 2, 2, uses_gpus=True) == 2


# ----------------------------------------------------------------------------- DistEnv.child

def test_child_of_second_task_gets_consecutive_ranks_and_doubled_world():
    task = DistEnv(rank=1, world_size=2, local_rank=0, local_world_size=1, master_addr="n0", master_port=15001,
                   launched=True, launcher="srun")
    children = [task.child(i, 2) for i in range(2)]
    assert [c.rank for c in children] == [2, 3]
    assert [c.world_size for c in children] == [4, 4]
    assert [c.local_rank for c in children] == [0, 1]
    assert [c.local_world_size for c in children] == [2, 2]
    assert all(c.launched and c.master_addr == "n0" and c.master_port == 15001 for c in children)


@pytest.mark.parametrize(("tasks", "tasks_per_node", "procs"), [(2, 1, 2), (4, 2, 3), (1, 1, 4), (6, 3, 1)])
def test_children_of_all_tasks_cover_every_rank_exactly_once(tasks, tasks_per_node, procs):
    world = tasks * procs
    envs = [DistEnv(rank=r, world_size=tasks, local_rank=r % tasks_per_node,
                    local_world_size=tasks_per_node).child(i, procs)
            for r in range(tasks) for i in range(procs)]
    ranks = [e.rank for e in envs]
    assert sorted(ranks) == list(range(world))
    assert len(set(ranks)) == len(ranks)
    assert {e.world_size for e in envs} == {world}
    for node in range(tasks // tasks_per_node):
        on_node = [e for e in envs if e.rank // (tasks_per_node * procs) == node]
        assert sorted(e.local_rank for e in on_node) == list(range(tasks_per_node * procs))
        assert {e.local_world_size for e in on_node} == {tasks_per_node * procs}


# ----------------------------------------------------------------------------- env_from_mpi

def test_env_from_mpi_reads_openmpi_variables():
    env = env_from_mpi(OMPI_ENV)
    assert env == DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="127.0.0.1",
                          master_port=29500, launched=True, launcher="mpirun")


def test_env_from_mpi_reads_pmi_variables_with_mpi_localrankid():
    env = env_from_mpi({**PMI_ENV, "MASTER_ADDR": "head"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 4, 0, 2)
    assert env.launcher == "mpirun" and env.launched


def test_env_from_mpi_pmi_local_rank_falls_back_to_pmi_local_variables():
    env = env_from_mpi({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)


def test_env_from_mpi_single_node_pmi_without_local_variables_uses_world():
    env = env_from_mpi({"PMI_RANK": "1", "PMI_SIZE": "3"})
    assert (env.local_rank, env.local_world_size, env.master_addr) == (0, 3, "127.0.0.1")


@pytest.mark.parametrize(("environ", "culprit"), [
    ({**OMPI_ENV, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ("OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2")),
    ({**PMI_ENV, "MPI_LOCALRANKID": "2"}, ("MPI_LOCALRANKID=2", "MPI_LOCALNRANKS=2")),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "3", "PMI_LOCAL_SIZE": "3"}, ("PMI_LOCAL_RANK=3",
                                                                                      "PMI_LOCAL_SIZE=3")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "2"}, ("PMI_LOCAL_RANK=2", "PMI_SIZE=2")),
])
def test_env_from_mpi_local_rank_outside_local_size_is_refused_naming_both(environ, culprit):
    with pytest.raises(UserError) as caught:
        env_from_mpi(environ)
    assert_names(single_line(str(caught.value)), *culprit)


@pytest.mark.parametrize("name", ["MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"])
def test_an_mpi_local_variable_that_is_not_an_integer_is_one_line_naming_it(name):
    with pytest.raises(UserError) as caught:
        env_from_mpi({"PMI_RANK": "1", "PMI_SIZE": "2", name: "one"})
    assert_names(str(caught.value), f"{name}='one'", "not an integer")


@pytest.mark.parametrize(("url", "addr", "port"), [
    ("tcp://host:1234", "host", 1234),
    ("tcp://10.1.2.3:29501", "10.1.2.3", 29501),
    ("tcp://node-7.cluster:65535", "node-7.cluster", 65535),
])
def test_env_from_mpi_dist_url_sets_master(url, addr, port):
    env = env_from_mpi({**OMPI_ENV, "MASTER_ADDR": "ignored", "MASTER_PORT": "1"}, dist_url=url)
    assert (env.master_addr, env.master_port) == (addr, port)


@pytest.mark.parametrize("url", ["host:1234", "http://host:1234", "tcp://host", "tcp://:1234", "tcp://host:0",
                                 "tcp://host:abc", "tcp://host:99999", "tcp://host:-1"])
def test_env_from_mpi_bad_dist_url_is_a_user_error(url):
    with pytest.raises(UserError, match="--dist-url .* must look like tcp://HOST:PORT"):
        env_from_mpi(OMPI_ENV, dist_url=url)


def test_env_from_mpi_empty_dist_url_counts_as_not_given():
    env = env_from_mpi({**OMPI_ENV, "MASTER_ADDR": "head", "MASTER_PORT": "23000"}, dist_url="")
    assert (env.master_addr, env.master_port) == ("head", 23000)


def test_env_from_mpi_master_addr_and_port_from_environment():
    env = env_from_mpi({**OMPI_ENV, "MASTER_ADDR": "head", "MASTER_PORT": "23000"})
    assert (env.master_addr, env.master_port) == ("head", 23000)


def test_env_from_mpi_master_port_argument_beats_environment():
    assert env_from_mpi({**OMPI_ENV, "MASTER_PORT": "23000"}, master_port=24000).master_port == 24000


@pytest.mark.parametrize("master", [{}, {"MASTER_ADDR": "127.0.0.1"}, {"MASTER_ADDR": "localhost"}])
def test_env_from_mpi_multi_node_job_with_local_master_is_refused(master):
    environ = {**OMPI_ENV, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", **master}
    with pytest.raises(UserError, match="set MASTER_ADDR or --dist-url"):
        env_from_mpi(environ)


def test_env_from_mpi_multi_node_job_with_real_master_is_accepted():
    environ = {**OMPI_ENV, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert env_from_mpi(environ, dist_url="tcp://head:1234").world_size == 4
    assert env_from_mpi({**environ, "MASTER_ADDR": "head"}).master_addr == "head"


def test_env_from_mpi_with_nothing_set_names_openmpi_and_pmi_variables():
    with pytest.raises(UserError) as info:
        env_from_mpi({"HOME": "/root"})
    assert "OMPI_COMM_WORLD_RANK" in str(info.value)
    assert "PMI_RANK" in str(info.value)


def test_env_from_mpi_missing_openmpi_local_size_names_it():
    environ = {k: v for k, v in OMPI_ENV.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"}
    with pytest.raises(UserError, match="OMPI_COMM_WORLD_LOCAL_SIZE"):
        env_from_mpi(environ)


# ----------------------------------------------------------------------------- resolve_launch

def test_resolve_env_without_variables_is_one_plain_process():
    plan = resolve_launch("env", {})
    assert plan == LaunchPlan(DistEnv(), 1)
    assert plan.env.launched is False


def test_resolve_env_under_srun_without_torchrun_is_refused_and_suggests_slurm():
    with pytest.raises(UserError, match="SLURM_STEP_NUM_TASKS=4.*pass --dist-init-method slurm"):
        resolve_launch("env", {**SLURM_ENV, "SLURM_STEP_NUM_TASKS": "4"})


def test_resolve_env_in_sbatch_script_shell_is_one_plain_process():
    plan = resolve_launch("env", {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"})
    assert plan == LaunchPlan(DistEnv(), 1)


def test_resolve_env_under_srun_with_one_task_is_one_plain_process():
    assert resolve_launch("env", {"SLURM_STEP_NUM_TASKS": "1"}).env.launched is False


@pytest.mark.parametrize(("var", "launcher"), [("OMPI_COMM_WORLD_SIZE", "mpirun"), ("PMI_SIZE", "mpiexec")])
def test_resolve_env_under_mpi_without_torchrun_is_refused_and_suggests_mpi(var, launcher):
    with pytest.raises(UserError, match=f"{launcher}.*{var}=2.*pass --dist-init-method mpi"):
        resolve_launch("env", {var: "2"})


def test_resolve_env_with_torchrun_variables_under_srun_uses_torchrun():
    plan = resolve_launch("env", {**TORCHRUN_ENV, "SLURM_STEP_NUM_TASKS": "4"})
    assert plan.env.launcher == "torchrun" and plan.env.rank == 1


def test_resolve_slurm_reads_slurm_variables():
    plan = resolve_launch("slurm", {**SLURM_ENV, "SLURM_JOB_NODELIST": "solo"}, visible_gpus=1)
    assert plan.procs_per_task == 1
    assert (plan.env.launcher, plan.env.rank, plan.env.master_addr) == ("srun", 5, "solo")


def test_resolve_slurm_master_port_argument_is_passed_through():
    plan = resolve_launch("slurm", {**SLURM_ENV, "SLURM_JOB_NODELIST": "solo"}, master_port=18000)
    assert plan.env.master_port == 18000


def test_resolve_slurm_one_task_per_node_starts_one_rank_per_gpu():
    environ = slurm(SLURM_JOB_NODELIST="solo", SLURM_TASKS_PER_NODE="1(x8)", SLURM_PROCID="2", SLURM_LOCALID="0")
    plan = resolve_launch("slurm", environ, visible_gpus=4)
    assert plan.procs_per_task == 4
    assert (plan.env.rank, plan.env.world_size, plan.env.local_world_size) == (2, 8, 1)


def test_resolve_slurm_with_torchrun_variables_lets_torchrun_win():
    plan = resolve_launch("slurm", {**SLURM_ENV, **TORCHRUN_ENV}, nproc_per_node=4, visible_gpus=8)
    assert plan.env.launcher == "torchrun"
    assert (plan.env.rank, plan.env.world_size, plan.env.master_addr, plan.env.master_port) == (1, 2, "node0", 29400)
    assert plan.procs_per_task == 1


@pytest.mark.parametrize(("nproc_per_node", "visible_gpus", "expected_procs"), [
    (None, 0, 1), (None, 1, 1), (None, 4, 4), (3, 0, 3), (2, 8, 2),
])
def test_resolve_spawn_procs_and_store(nproc_per_node, visible_gpus, expected_procs):
    plan = resolve_launch("spawn", {}, nproc_per_node=nproc_per_node, visible_gpus=visible_gpus)
    assert plan.procs_per_task == expected_procs
    assert plan.env.master_port == 0
    assert plan.env.store_is_external is True
    assert plan.env.launcher == "spawn"


def test_resolve_spawn_keeps_an_explicit_master_port():
    assert resolve_launch("spawn", {}, master_port=25000).env.master_port == 25000


def test_resolve_mpi_reads_mpi_variables_and_dist_url():
    plan = resolve_launch("mpi", OMPI_ENV, dist_url="tcp://head:4321")
    assert plan.procs_per_task == 1
    assert (plan.env.launcher, plan.env.rank, plan.env.master_addr, plan.env.master_port) == (
        "mpirun", 1, "head", 4321)


def test_resolve_mpi_without_mpi_variables_is_refused():
    with pytest.raises(UserError, match="OMPI_COMM_WORLD_RANK.*PMI_RANK"):
        resolve_launch("mpi", {})


# ----------------------------------------------------------------------------- what reaches the rendezvous store

READ_BY = {  # each launcher's reading of a valid environment of its own, with `changes` made to it
    "torchrun": lambda **changes: env_from_torchrun({**WORKER_ENV, **changes}),
    "slurm": lambda **changes: env_from_slurm(slurm(**changes), fallback=never_called),
    "mpi": lambda **changes: env_from_mpi({**OMPI_ENV, **changes}),
}


@pytest.mark.parametrize("port", ["99999", "-5", "0"])
@pytest.mark.parametrize("launcher", READ_BY)
def test_a_master_port_variable_that_is_no_port_is_refused_naming_it(launcher, port):
    """TCPStore would raise a TypeError, a traceback, at the rendezvous."""
    with pytest.raises(UserError) as info:
        READ_BY[launcher](MASTER_PORT=port)
    assert_names(str(info.value), f"MASTER_PORT={port}")


@pytest.mark.parametrize(("read", "name"), [(READ_BY["torchrun"], "WORLD_SIZE"), (READ_BY["slurm"], "SLURM_NTASKS"),
                                            (READ_BY["mpi"], "OMPI_COMM_WORLD_SIZE"),
                                            (lambda **changes: env_from_mpi({**PMI_ENV, **changes}), "PMI_SIZE")])
def test_a_world_size_variable_too_large_for_the_store_is_refused_naming_it(read, name):
    """TCPStore takes a C int: a larger world raises a TypeError at the rendezvous."""
    with pytest.raises(UserError) as info:
        read(**{name: str(2**40)})
    assert_names(str(info.value), f"{name}={2**40}")


@pytest.mark.parametrize(("launcher", "changes", "names"), [
    ("slurm", {"SLURM_PROCID": "8"}, ["SLURM_PROCID=8", "SLURM_NTASKS=8"]),
    ("mpi", {"OMPI_COMM_WORLD_RANK": "5"}, ["OMPI_COMM_WORLD_RANK=5", "OMPI_COMM_WORLD_SIZE=2"]),
], ids=["slurm", "mpi"])
def test_a_rank_outside_the_world_is_refused_naming_both_variables(launcher, changes, names):
    """It would wait --dist-timeout for a rendezvous that cannot complete, then print C++ frames."""
    with pytest.raises(UserError) as info:
        READ_BY[launcher](**changes)
    assert_names(str(info.value), *names)


@pytest.mark.parametrize(("launcher", "name", "value"), [
    ("torchrun", "LOCAL_RANK", "-1"), ("torchrun", "LOCAL_WORLD_SIZE", "0"), ("slurm", "SLURM_LOCALID", "-1"),
    ("mpi", "OMPI_COMM_WORLD_LOCAL_SIZE", "0"), ("mpi", "OMPI_COMM_WORLD_LOCAL_RANK", "-2"),
    ("slurm", "SLURM_RESTART_COUNT", "x"),
])
def test_a_local_rank_or_size_or_count_out_of_range_is_refused_naming_it(launcher, name, value):
    with pytest.raises(UserError) as info:
        READ_BY[launcher](**{name: value})
    assert_names(str(info.value), f"{name}={value!r}" if value == "x" else f"{name}={value}")


def test_an_empty_master_addr_under_torchrun_is_refused_naming_it():
    """It was taken as a host name: the rendezvous retried '' until --dist-timeout."""
    with pytest.raises(UserError) as info:
        READ_BY["torchrun"](MASTER_ADDR="")
    assert_names(str(info.value), "MASTER_ADDR")


@pytest.mark.parametrize(("environ", "missing"), [
    ({"OMPI_COMM_WORLD_RANK": "0"},
     ["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"]),
    ({"PMI_RANK": "0"}, ["PMI_SIZE"]),
], ids=["ompi", "pmi"])
def test_mpi_with_some_of_its_variables_names_the_missing_ones(environ, missing):
    with pytest.raises(UserError) as info:
        env_from_mpi(environ)
    assert_names(str(info.value), *missing)


@pytest.mark.parametrize(("method", "flags", "named"), [
    ("env", {"nproc_per_node": 2}, ["--nproc-per-node", "spawn", "env"]),
    ("env", {"master_port": 29999}, ["--master-port", "env"]),
    ("env", {"dist_url": "tcp://h:1"}, ["--dist-url", "mpi", "env"]),
    ("spawn", {"dist_url": "tcp://h:1"}, ["--dist-url", "mpi", "spawn"]),
])
def test_a_flag_the_launch_method_does_not_read_is_warned_of_not_refused(capsys, method, flags, named):
    """A recipe may carry it; ignored silently, `--nproc-per-node 2` under env ran one process unsaid."""
    resolve_launch(method, {}, **flags)
    warning = capsys.readouterr().err
    assert warning.startswith("warning:") and len(warning.splitlines()) == 1
    assert_names(warning, *named)


def test_flags_the_method_reads_and_other_ranks_warn_of_nothing(capsys):
    resolve_launch("spawn", {}, nproc_per_node=2, master_port=29999)
    resolve_launch("env", {**WORKER_ENV}, nproc_per_node=2)  # rank 3: rank 0 said it
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("seconds", ["1e10", "1e15", "604801"])
def test_a_dist_timeout_beyond_a_week_is_refused_naming_the_flag(capsys, seconds):
    """1e15 ended in an OverflowError traceback; 1e10 made the store time out at once."""
    from imagenet_elastic.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["/data", "--dist-timeout", seconds])
    assert info.value.code == 2
    assert_names(capsys.readouterr().err, "--dist-timeout", seconds)
    assert build_parser().parse_args(["/data", "--dist-timeout", "604800"]).dist_timeout == 604800

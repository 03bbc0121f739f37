"""What the GPU checks stand on, checked on a CPU: a device session is rare and lasts 30 minutes, and the first
one lost a test to an import that only ran on CUDA. tests/test_cuda.py imports and its command lines parse; the
probe its two-rank test starts (tests/state_probe.py) patches the very functions the build steps call.
scripts/gpu_checks.sh's parts run in tests/test_gpu_checks.py."""

from __future__ import annotations

import contextlib

import fault_injection as fi
import pytest
import state_probe
import test_cuda
import torch
import torch.distributed as dist
from inprocess import in_memory

from imagenet_elastic import cli
from imagenet_elastic.launch import distributed
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.report import startup_table
from imagenet_elastic.report.console import Console
from imagenet_elastic.train import build


def test_the_cuda_tests_import_here_and_are_all_marked_cuda():
    """Imported above, as the GPU machine imports them: every project module they name resolves."""
    assert [mark.name for mark in test_cuda.pytestmark] == ["cuda", "skipif"]


def test_the_cuda_tests_command_lines_parse_and_stay_eager(tmp_path):
    """Eager whatever the default of --compile on CUDA: a compiled tiny model would cost each run a minute."""
    rounds = test_cuda.two_ranks_rounds(str(tmp_path), str(tmp_path / "ckpt"))
    for argv in [test_cuda.nccl_run_args(str(tmp_path), str(tmp_path / "ckpt")), *rounds]:
        config, _ = cli.parse(argv)
        assert config.device == "cuda" and config.compile is False
    assert [cli.parse(argv)[0].resume for argv in rounds] == [None, "auto"]


@pytest.fixture
def probe_patches(monkeypatch):
    """What share_one_gpu replaces, and what the build steps it runs here set, put back after the test; CUDA's
    device choice recorded instead of made."""
    for module, name in ((distributed, "select_device"), (distributed, "group_options"),
                         (startup_table, "group_options")):
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    threads = torch.get_num_threads()
    yield chosen
    torch.set_num_threads(threads)


def test_share_one_gpu_gives_the_build_steps_cuda_0_and_a_gloo_group(probe_patches, tmp_path):
    """What the two ranks on one GPU run (tests/test_cuda.py): check_inputs picks the device (through
    distributed.select_device) and join_job forms the group (distributed.init_process_group, through its module's
    group_options). Here with one rank: unpatched, --device cuda is refused on a CPU and NCCL has no device; a
    build step that calls a moved function fails here, not on the GPU."""
    state_probe.share_one_gpu()
    config, _ = cli.parse([str(tmp_path), "--model", "test_resnet", "--device", "cuda", "--workers", "0",
                           "--checkpoints-path", str(tmp_path / "ckpt")])
    env = DistEnv(master_port=fi.free_port(), launched=True, launcher="torchrun")
    console = Console(False)
    with contextlib.ExitStack() as stack:
        inputs, snapshot = build.check_inputs(config, env, console, stack, in_memory(2, 2, 1))
        assert inputs.device == torch.device("cuda", 0) and probe_patches == [0]
        build.join_job(config, env, console, inputs, snapshot, stack)
        assert dist.get_backend() == "gloo"
    assert not dist.is_initialized()
    assert startup_table.group_options(inputs.device) == {"backend": "gloo"}  # what the table says

"""What the GPU checks stand on, checked on a CPU: GPU time is short, and the first GPU run lost a test to an import
that only ran on CUDA. tests/gpu/test_cuda.py imports and its command lines parse; the
probe its two-rank test starts (tests/state_probe.py) patches the very functions the build steps call; the
profiler helpers its sync checks use (tests/host_waits.py) read torch's events; and its photo-like JPEGs are
photo-like where its bar assumes it (the decoders' chroma fill). scripts/gpu_checks.sh's parts run in
tests/scripts/test_gpu_checks.py."""

from __future__ import annotations

import contextlib
import types

import fault_injection as fi
import numpy as np
import pytest
import state_probe
import test_cuda
import torch
import torch.distributed as dist
from host_waits import HostCopy, device_work, host_to_device_copies
from inprocess import in_memory
from makers import photo_like
from torch.autograd import DeviceType

from imagenet_elastic import cli
from imagenet_elastic.launch import distributed
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.launch.preemption import PreemptionFlag
from imagenet_elastic.report.console import Console
from imagenet_elastic.train import build, startup_table


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
    """What the two ranks on one GPU run (tests/gpu/test_cuda.py): check_inputs picks the device (through
    distributed.select_device) and join_job forms the group (distributed.init_process_group, through its module's
    group_options). Here with one rank: unpatched, --device cuda is refused on a CPU and NCCL has no device; a
    build step that calls a moved function fails here, not on the GPU."""
    state_probe.share_one_gpu()
    config, _ = cli.parse([str(tmp_path), "--model", "test_resnet", "--device", "cuda", "--workers", "0",
                           "--checkpoints-path", str(tmp_path / "ckpt")])
    env = DistEnv(master_port=fi.free_port(), launched=True, launcher="torchrun")
    run = build.Run(config, env, Console(False), PreemptionFlag(()))
    with contextlib.ExitStack() as stack:
        inputs, snapshot = build.check_inputs(run, stack, in_memory(2, 2, 1))
        assert inputs.device == torch.device("cuda", 0) and probe_patches == [0]
        build.join_job(run, inputs, snapshot, stack)
        assert dist.get_backend() == "gloo"
    assert not dist.is_initialized()
    assert startup_table.group_options(inputs.device) == {"backend": "gloo"}  # what the table says


# ----------------------------------------------------------------------------- host_waits: the profiler's events

def event(name: str, stream: int = 7, start: float = 0.0, device: DeviceType = DeviceType.CUDA,
          annotation: bool = False) -> types.SimpleNamespace:
    """A profiler event as torch.autograd.profiler_util.FunctionEvent has it, as far as host_waits reads it."""
    return types.SimpleNamespace(name=name, device_resource_id=stream, time_range=types.SimpleNamespace(start=start),
                                 device_type=device, is_user_annotation=annotation)


def test_host_copies_are_found_by_their_memory_and_stream_in_the_order_they_ran():
    events = [event("Memcpy HtoD (Pageable -> Device)", stream=20, start=5.0),
              event("Memcpy HtoD (Pinned -> Device)", stream=7, start=1.0),
              event("Memcpy DtoH (Device -> Pageable)", stream=7, start=2.0),
              event("Memcpy DtoD (Device -> Device)", stream=7, start=3.0),
              event("cudaMemcpyAsync", start=0.5, device=DeviceType.CPU),
              event("void at::native::vectorized_elementwise_kernel<4, ...>", start=4.0),
              event("Memset (Device)", start=6.0),
              event("Optimizer.step#SGD.step", start=0.0, annotation=True)]
    assert host_to_device_copies(events) == [HostCopy("Pinned", 7, 1.0), HostCopy("Pageable", 20, 5.0)]
    assert [copy.pageable for copy in host_to_device_copies(events)] == [False, True]
    assert device_work(events) == 6  # the four copies, the kernel and the fill; not the runtime call nor the range


def test_host_waits_reads_the_events_of_a_real_profile():
    """torch's own FunctionEvents have what host_waits reads (a range named like a copy stands in for one)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, \
            torch.profiler.record_function("Memcpy HtoD (Pageable -> Device)"):
        torch.ones(4).add_(1)
    (copy,) = host_to_device_copies(profile.events())
    assert copy.pageable and isinstance(copy.stream, int) and copy.start_us >= 0
    assert device_work(profile.events()) == 0  # CPU events only


# ----------------------------------------------------------------------------- the photo-like fixtures

def chroma_fill_difference(pixels: np.ndarray) -> float:
    """Mean level difference per channel between two fills of the 4:2:0 chroma of `pixels`: libjpeg-turbo's
    (interpolated: each sample 3/4 of the nearest stored one and 1/4 of the next, in each direction) and nvJPEG's
    (the nearest stored sample). Quantization left out: this is what the fill alone changes."""
    rgb = pixels[: pixels.shape[0] // 2 * 2, : pixels.shape[1] // 2 * 2].astype(np.float64)
    to_ycbcr = np.array([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]])
    ycbcr = rgb @ to_ycbcr.T
    h, w = rgb.shape[0] // 2, rgb.shape[1] // 2
    stored = ycbcr[..., 1:].reshape(h, 2, w, 2, 2).mean(axis=(1, 3))  # the encoder's 2x2 means

    def interpolated(plane: np.ndarray, axis: int) -> np.ndarray:
        padded = np.pad(plane, [(1, 1) if a == axis else (0, 0) for a in range(3)], mode="edge")
        before, here, after = (np.take(padded, range(k, k + plane.shape[axis]), axis=axis) for k in range(3))
        shape = list(plane.shape)
        shape[axis] *= 2
        return np.stack([0.75 * here + 0.25 * before, 0.75 * here + 0.25 * after], axis=axis + 1).reshape(shape)

    nearest = stored.repeat(2, axis=0).repeat(2, axis=1)
    smooth = interpolated(interpolated(stored, 0), 1)
    back = np.linalg.inv(to_ycbcr).T
    fill = [np.round(np.concatenate([ycbcr[..., :1], chroma], axis=-1) @ back) for chroma in (nearest, smooth)]
    return float(np.abs(np.clip(fill[0], 0, 255) - np.clip(fill[1], 0, 255)).mean())


def test_photo_like_images_differ_by_their_chroma_fill_as_photos_do_and_noise_does_not():
    """test_cuda's bar for 4:2:0 photos (< 1.5 levels per crop) assumes photo-like content: real photos' whole
    decodes differed by 0.66 level on the first GPU run, chroma fill and IDCT together. Noise, whose every pixel is
    a colour edge, differs by far more (4-10 levels per crop on that run)."""
    photos = [chroma_fill_difference(photo_like(120 + 20 * i, 340 - 15 * i, seed=i)) for i in range(12)]
    assert min(photos) > 0.2 and max(photos) < 0.6, photos
    noise = np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    assert chroma_fill_difference(noise) > 8

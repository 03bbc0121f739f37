"""The CUDA paths on a real GPU: NCCL, nvJPEG against the CPU decoder (crops and policies on 4:4:4 JPEGs, the
decoder's own difference on 4:2:0 photo-like ones), AMP steps, the pinned host copy of a background checkpoint,
a resume of two ranks into CUDA's fused SGD, an fp16 first step that overflows, and a training loop that never
makes the host wait for the GPU (sync-debug mode, the profiler's copies from pageable memory, and a busy training
stream that the policy and a step must not wait for). The rest of the suite tests their logic on the CPU; these
run the kernels. tests/gpu/test_gpu_probes.py checks on the CPU that this module imports, that its command lines
parse, and what its helpers (host_waits.py, state_probe.py, test_data.photo_like) do.

Marked `cuda` and skipped where no CUDA device is visible (CI has none). On a GPU machine:
`python3 -m pytest -q -m cuda tests/gpu/test_cuda.py` (scripts/gpu_checks.sh runs it as its `tests` part).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fault_injection as fi
import numpy as np
import pytest
import torch
from conftest import REPO, SMALL_RUN, load_checkpoint, several_at_once, torchrun_cmd
from host_waits import LAUNCH_QUEUE, device_work, host_to_device_copies
from makers import write_jpeg, write_photo
from PIL import Image
from state_probe import ONE_GPU, PROBE_DIR, layout_mismatches
from torch.profiler import ProfilerActivity

from imagenet_elastic.checkpoint import share
from imagenet_elastic.checkpoint.saving import HostCopy
from imagenet_elastic.data import pipeline, pixels
from imagenet_elastic.data.augment import POLICIES, Augment
from imagenet_elastic.data.device import feed, gpu_decode, jpeg_decoders
from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.data.sources.image_folder import ImageFolder, scan_image_folder
from imagenet_elastic.models.create import create_ema, create_model
from imagenet_elastic.optim.optimizer import create_optimizer
from imagenet_elastic.train.mixing import Mixer
from imagenet_elastic.train.state import PendingSteps, TrainState
from imagenet_elastic.train.step import StepContext, TrainLoss, train_step

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
GPU = torch.device("cuda", 0)


def twelve(tmp_path, write) -> ImageFolder:
    """Twelve JPEGs from 120 to 340 pixels wide, `write(path, width, height, seed)` each: crops at 120 px never
    take DCT scaling on the CPU path."""
    for i in range(12):
        write(str(tmp_path / "train" / f"c{i % 3}" / f"{i}.jpg"), 120 + 20 * i, 340 - 15 * i, seed=i)
    return scan_image_folder(str(tmp_path / "train"), "train")


@pytest.fixture
def jpegs(tmp_path):
    """Noise with full-resolution (4:4:4) chroma, where any two crops differ. With 4:2:0 chroma nvJPEG (which
    fills it by nearest sample) and libjpeg-turbo (which interpolates) differ on noise by 4-10 levels per image
    (the first GPU run): the decoders, not the crops. 4:4:4 leaves the crops' and the policies' logic to compare."""
    return twelve(tmp_path, functools.partial(write_jpeg, subsampling="4:4:4"))


@pytest.fixture
def photos(tmp_path):
    """Photo-like JPEGs with 4:2:0 chroma, as cameras and ImageNet's files are (test_data.photo_like)."""
    return twelve(tmp_path, write_photo)


def decode_on_gpu(index, augment: Augment, keys: list, library: str = "torchvision") -> torch.Tensor:
    dataset = pipeline.TrainDataset(index, 120, 4, gpu_decode.encode_bytes, augment)
    batch = gpu_decode.collate([dataset[key] for key in keys])
    jpeg = jpeg_decoders.JPEG_DECODERS[library].make(GPU, 2)
    images = gpu_decode.BatchDecoder(GPU, print, jpeg)(batch).images
    assert images.device == GPU and images.dtype == torch.uint8 and images.shape == (len(keys), 120, 120, 3)
    return images.cpu()


def level_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().mean(dim=(1, 2, 3))


def against_the_workers(index, augment: Augment, epochs: int, library: str = "torchvision"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image, how far the GPU's batch (seed 4) is from the worker path's with the same seed, and with another."""
    keys = [(e, i) for e in range(epochs) for i in range(len(index))]
    gpu = decode_on_gpu(index, augment, keys, library)
    workers = [torch.stack([pipeline.TrainDataset(index, 120, seed, augment=augment)[key][0] for key in keys])
               for seed in (4, 5)]
    return level_difference(gpu, workers[0]), level_difference(gpu, workers[1])


def test_nvjpeg_batches_are_the_cpu_paths_crops_within_a_level_or_two(jpegs):
    keys = [(e, i) for e in range(2) for i in range(len(jpegs))]
    gpu = decode_on_gpu(jpegs, Augment(), keys)
    cpu = torch.stack([pipeline.TrainDataset(jpegs, 120, 4)[key][0] for key in keys])
    difference = level_difference(gpu, cpu)
    assert difference.max() < 2, difference  # IDCT and float resize rounding; another crop differs by ~60


PHOTO_CROPS = Augment(scale=(0.25, 1.0))  # at least a quarter of the image: a crop, not one colour edge


def test_nvjpeg_crops_of_4_2_0_photos_are_the_cpu_paths_within_what_its_chroma_fill_explains(photos):
    """nvJPEG fills 4:2:0 chroma by nearest sample where libjpeg-turbo interpolates: on real photos the whole
    decode differed from PIL's by 0.66 level on average (the first GPU run, 5,120 photos). On these photo-like
    images the chroma fill alone differs by 0.3-0.5 level per image, at most ~0.8 over a crop (simulated on the
    CPU: tests/gpu/test_gpu_probes.py), and the IDCT and the float resize's rounding add a few tenths on smooth
    images (< 2 levels together on noise, the test above). Hence < 1.5 per crop: room for all three, while a
    wrong crop, flip or channel order differs by 10 levels or more (another seed's crops: ~30)."""
    same, other = against_the_workers(photos, PHOTO_CROPS, epochs=2)
    assert same.max() < 1.5, same
    assert other.min() > 4 * same.max(), other


def skip_unless_here(library: str) -> None:
    """--gpu-decoder nvimgcodec is an extra (scripts/gpu_checks.sh installs it where its wheels travelled)."""
    reason = jpeg_decoders.JPEG_DECODERS[library].unavailable(GPU)
    if reason is not None:
        pytest.skip(f"{library} {reason}")


@pytest.fixture
def nvimgcodec():
    skip_unless_here("nvimgcodec")


def test_nvimgcodec_decodes_4_2_0_photos_to_the_cpu_paths_very_pixels(photos, nvimgcodec):
    """It upsamples 4:2:0 chroma as libjpeg-turbo does: 0.0 level from PIL on 5,120 photos in the first GPU run,
    where torchvision's nvJPEG differs by 0.3-0.5 level per image on these (the test above)."""
    raws = [Path(photos.path(i)).read_bytes() for i in range(len(photos))]
    decoded = jpeg_decoders.NvImageCodecJpeg(GPU, 2).decode([pixels.byte_tensor(r) for r in raws])
    pil = [torch.from_numpy(np.asarray(Image.open(io.BytesIO(r)).convert("RGB"))).permute(2, 0, 1) for r in raws]
    difference = torch.stack([level_difference(d.cpu()[None], p[None])[0] for d, p in zip(decoded, pil)])
    assert difference.max() < 0.05, difference


def test_nvimgcodec_batches_of_4_2_0_photos_are_the_same_batches_on_cpu_tensors_but_for_float_rounding(
        photos, nvimgcodec):
    """The device path on the GPU and on the CPU's tensors (nvImageCodec's libjpeg-turbo backend), from the same
    worker batch: the decoders agree, so only the float resize's sums may round a pixel that lands on .5 the other
    way (nvJPEG's chroma fill would move most pixels of these photos by a level or more)."""
    keys = [(e, i) for e in range(2) for i in range(len(photos))]
    dataset = pipeline.TrainDataset(photos, 120, 4, gpu_decode.encode_bytes, PHOTO_CROPS)
    cpu = torch.device("cpu")
    on_cpu = gpu_decode.BatchDecoder(cpu, print, jpeg_decoders.NvImageCodecJpeg(cpu, 2))(
        gpu_decode.collate([dataset[key] for key in keys])).images
    difference = (decode_on_gpu(photos, PHOTO_CROPS, keys, "nvimgcodec").int() - on_cpu.int()).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 1e-3, (difference > 0).float().mean()


def test_nvimgcodec_decodes_into_memory_that_torchs_allocator_counts(photos, nvimgcodec):
    """Left to itself nvImageCodec takes its images from CUDA's default memory pool (~144 MB a batch of 256
    ImageNet photos), which torch's counters, empty_cache and --micro-batch auto's out-of-memory handling cannot
    see; it decodes into one tensor torch allocated instead, the CPU path's pixels still."""
    raws = [Path(photos.path(i)).read_bytes() for i in range(len(photos))]
    jpeg = jpeg_decoders.NvImageCodecJpeg(GPU, 2)
    jpeg.decode([pixels.byte_tensor(raws[0])])  # the decoder and its own scratch buffers
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(GPU)
    decoded = jpeg.decode([pixels.byte_tensor(raw) for raw in raws])
    grown = torch.cuda.memory_allocated(GPU) - before
    assert grown >= sum(image.numel() for image in decoded) > 0, grown
    assert len({image.untyped_storage().data_ptr() for image in decoded}) == 1
    pil = [torch.from_numpy(np.asarray(Image.open(io.BytesIO(r)).convert("RGB"))).permute(2, 0, 1) for r in raws]
    assert max(level_difference(d.cpu()[None], p[None])[0] for d, p in zip(decoded, pil)) < 0.05


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_the_policy_and_erasing_on_the_gpu_draw_what_the_workers_draw(jpegs, policy):
    same, other = against_the_workers(jpegs, Augment(policy=policy, erase=0.5), epochs=3)
    assert same.max() < 4, same
    assert other.mean() > 4 * same.mean() + 1


@pytest.mark.parametrize("blurpool", [False, True], ids=["plain", "blurpool"])  # the FFCV recipes' depthwise blur
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_an_amp_step_on_the_gpu_trains(amp, blurpool):
    model = create_model("test_resnet", 10, blurpool=blurpool).to(GPU, memory_format=torch.channels_last)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, GPU)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    ctx = StepContext(model, optimizer, scaler, TrainLoss(0.1), ModelInput(GPU, amp, channels_last=True))
    images = torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8, device=GPU)
    labels = torch.randint(0, 10, (16,), device=GPU)
    losses = [float(train_step(ctx, [Batch(images, labels)], [slice(0, 16)], 16, 0.1, seed=0, step=s))
              for s in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_pinned_host_copy_of_a_checkpoint_holds_the_values_at_the_copy():
    state = {"model": {"w": torch.randn(1000, 1000, device=GPU)}, "list": [torch.arange(7, device=GPU)], "n": 3}
    expected = state["model"]["w"].cpu().clone()
    host = HostCopy(pin=True)
    main = busy_training_stream()  # the step that made the state is still running
    copied = host.copy(state)
    assert not main.query(), "the copy waited for the training stream"
    state["model"]["w"].add_(1)  # training goes on at once, queued behind the copy
    host.wait_copied()  # what the writer thread does before it reads
    assert copied["model"]["w"].is_pinned() and torch.equal(copied["model"]["w"], expected)
    assert torch.equal(copied["list"][0], torch.arange(7)) and copied["n"] == 3
    again = host.copy(state)
    host.wait_copied()
    assert again["model"]["w"].data_ptr() == copied["model"]["w"].data_ptr()  # the buffers are reused
    assert torch.equal(again["model"]["w"], expected + 1)


def nccl_run_args(data: str, checkpoints: str) -> list[str]:
    """The one NCCL rank's command line (tests/gpu/test_gpu_probes.py parses it on a CPU). Eager, whatever the
    default of --compile on CUDA: compiling would cost the test a minute."""
    return [data, *SMALL_RUN, "--device", "cuda", "--amp", "auto", "--decode", "gpu", "--no-compile", "--epochs", "1",
            "--checkpoints-path", checkpoints]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_nccl_rank_trains_with_decode_gpu_and_a_background_checkpoint(image_folder, tmp_path):
    env = fi.clean_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    cmd = torchrun_cmd(1, *nccl_run_args(str(image_folder), str(tmp_path / "ckpt")))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "batched on cuda" in result.stdout and "nccl" in result.stdout, result.stdout
    row = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["val_samples"] == 35 and 0 <= row["val_top1"] <= 100
    weights = load_checkpoint(tmp_path / "ckpt" / "last.pt")["model"]
    assert all(t.device.type == "cpu" and torch.isfinite(t.float()).all() for t in weights.values())


# ----------------------------------------------------------------------------- resume into fused SGD (issue 26)

def gpu_state(channels_last: bool = True) -> TrainState:
    torch.manual_seed(0)
    model = create_model("test_resnet", 10).to(GPU)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, GPU)
    assert optimizer.param_groups[0]["fused"]  # the kernel that checks strides
    return TrainState(model, optimizer, torch.amp.GradScaler("cuda", enabled=False), ema=create_ema(model, 0.9, False))


def steps_on_gpu(state: TrainState, count: int, amp=torch.bfloat16) -> list[float]:
    ctx = StepContext(state.model, state.optimizer, state.scaler, TrainLoss(0.1),
                      ModelInput(GPU, amp, channels_last=True))
    generator = torch.Generator().manual_seed(5)
    images = torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8, generator=generator).to(GPU)
    labels = torch.randint(0, 10, (16,), generator=generator).to(GPU)
    return [float(train_step(ctx, [Batch(images, labels)], [slice(0, 16)], 16, 0.1, seed=0, step=s))
            for s in range(count)]


@pytest.mark.parametrize("path", ["load_once", "direct_other_layout"])
def test_a_resumed_state_steps_with_cudas_fused_sgd(path):
    """What every rank but 0 did at each multi-GPU restart: take rank 0's checkpoint through load-once, then
    step; and a run resumed with the other --channels-last setting. Fused SGD checks the strides."""
    trained = gpu_state()
    steps_on_gpu(trained, 2)
    snapshot = trained.capture({}, {})
    snapshot = share.unpack(*share.pack(snapshot)) if path == "load_once" else \
        copy.deepcopy({k: v for k, v in snapshot.items()})
    resumed = gpu_state(channels_last=path == "load_once")
    resumed.apply(snapshot)
    checked, wrong = layout_mismatches(resumed.model, resumed.optimizer, resumed.ema.module)
    assert checked and not wrong, wrong
    assert all(torch.isfinite(torch.tensor(steps_on_gpu(resumed, 2))))


def two_ranks_rounds(data: str, checkpoints: str) -> list[list[str]]:
    """The two rounds' command lines of the two ranks on one GPU: train, then resume (tests/gpu/test_gpu_probes.py
    parses them on a CPU); eager, as `nccl_run_args`."""
    args = [data, *SMALL_RUN, "--device", "cuda", "--amp", "bf16", "--no-compile", "--model-ema",
            "--max-steps-per-epoch", "3", "--checkpoints-path", checkpoints]
    return [[*args, "--epochs", "1"], [*args, "--epochs", "2", "--resume"]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_on_one_gpu_resume_under_torchrun_and_train(image_folder, tmp_path):
    """Real torchrun and load-once on CUDA: two ranks share device 0 over gloo (NCCL refuses two ranks on one
    GPU), train, are restarted with --resume and train on with fused SGD; both report their state's layout."""
    several_at_once()
    probe = tmp_path / "probe"
    probe.mkdir()
    env = fi.clean_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
                       **{PROBE_DIR: str(probe), ONE_GPU: "1"})
    for args in two_ranks_rounds(str(image_folder), str(tmp_path / "ckpt")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "tests" / "state_probe.py"), *args]
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        report = json.loads((probe / f"rank{rank}.json").read_text())
        assert report["resumed"] and report["device"] == "cuda:0" and report["checked"] and not report["mismatches"]
    assert load_checkpoint(tmp_path / "ckpt" / "last.pt")["step"] == 6


def test_an_fp16_first_step_that_overflows_leaves_fused_momentum_as_unfused_sgds():
    """GradScaler's initial scale makes the first fp16 backward overflow here; the fused kernel then skips the
    step, and the next one must not read momentum that was never written."""
    runs = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = create_model("test_resnet", 10).to(GPU, memory_format=torch.channels_last)
        optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, GPU, fused=fused)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 24)  # fp16's gradients overflow at this scale
        ctx = StepContext(model, optimizer, scaler, TrainLoss(0.1), ModelInput(GPU, torch.float16, channels_last=True))
        images = torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8, device=GPU)
        labels = torch.randint(0, 10, (16,), device=GPU)
        scales = [scaler.get_scale()]
        for s in range(30):  # the scale halves at each overflowing step until one goes through, and then stays
            train_step(ctx, [Batch(images, labels)], [slice(0, 16)], 16, 0.1, seed=0, step=s)
            scales.append(scaler.get_scale())
            if scales[-1] == scales[-2]:
                break
        assert scales[1] == 2.0 ** 23 and scales[-1] == scales[-2], scales  # overflowed first, then stepped
        runs[fused] = (model, optimizer, scales)
    assert runs[True][2] == runs[False][2]
    (fused_model, fused_opt, _), (plain_model, plain_opt, _) = runs[True], runs[False]
    for p, q in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(fused_opt.state[p]["momentum_buffer"], plain_opt.state[q]["momentum_buffer"],
                                   rtol=1e-3, atol=1e-5)
        assert torch.isfinite(fused_opt.state[p]["momentum_buffer"]).all()


# ----------------------------------------------------------------------------- the host never waits for the GPU

BUSY_CYCLES = 4_000_000_000  # torch.cuda._sleep: ~2 s of a GPU clock, far longer than any host work below


def busy_training_stream() -> torch.cuda.Stream:
    """The training stream with a long kernel queued on it, as the previous step's forward and backward are."""
    main = torch.cuda.current_stream(GPU)
    torch.cuda._sleep(BUSY_CYCLES)
    return main


@contextlib.contextmanager
def profiling() -> Iterator[list]:
    """The block's events under torch.profiler, CPU and CUDA (the device's kernels and copies among them): the
    list it yields holds them once the block is done, and the device with it."""
    events: list = []
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profile:
        yield events
        torch.cuda.synchronize()
    events.extend(profile.events())


def mark_the_current_stream() -> None:
    """A copy from pinned memory on the current (training) stream, waited for: the first copy of a profile that
    begins with it, so that the profile names that stream (host_waits.HostCopy.stream)."""
    torch.zeros(8, dtype=torch.uint8).pin_memory().to(GPU, non_blocking=True)
    torch.cuda.synchronize()


@pytest.mark.parametrize("library", list(jpeg_decoders.JPEG_DECODERS))
@pytest.mark.parametrize("policy", ["ta_wide", "imagenet"])
def test_the_policy_and_erasing_finish_while_the_training_stream_is_still_busy(jpegs, policy, library):
    """torchvision's tensor kernels copy small host tensors (affine matrices, erasing's fill) from pageable
    memory, and such a copy waits for its stream's queue; on the training stream that queue is the previous
    step's forward and backward. On their side stream they wait for the decode alone: the profiler finds no copy
    from pageable memory on the training stream, and a batch comes out while that stream is still busy. Only
    the public decode path (TrainDataset, collate, BatchDecoder, device_batches) is used, with each JPEG library:
    any way of decoding behind it must pass."""
    skip_unless_here(library)
    augment = Augment(policy=policy, erase=1.0)
    dataset = pipeline.TrainDataset(jpegs, 120, 4, gpu_decode.encode_bytes, augment)
    batch = gpu_decode.collate([dataset[(0, i)] for i in range(len(jpegs))])
    batch = batch.pin_memory() if hasattr(batch, "pin_memory") else batch  # as the loader's pin thread hands it over
    decoder = gpu_decode.BatchDecoder(GPU, print, jpeg_decoders.JPEG_DECODERS[library].make(GPU, 2))
    expected = next(feed.device_batches([batch], GPU, decoder)).images.clone()  # also warms nvJPEG, the kernels
    with profiling() as events:
        mark_the_current_stream()
        images = next(feed.device_batches([batch], GPU, decoder)).images
    copies = host_to_device_copies(events)
    assert copies and not copies[0].pageable, f"the profiler did not see the marking copy first: {copies[:3]}"
    waiting = [copy for copy in copies if copy.pageable and copy.stream == copies[0].stream]
    assert not waiting, f"{len(waiting)} copies from pageable memory on the training stream"
    assert torch.equal(images, expected)
    main = busy_training_stream()
    images = next(feed.device_batches([batch], GPU, decoder)).images
    assert not main.query(), "the policy waited for the training stream's queue"
    torch.cuda.synchronize()
    assert torch.equal(images, expected)


def hot_loop_batches(steps: int, plan: BatchPlan) -> list[Batch]:
    """What the loader hands over under --decode cpu for `steps` steps: micro-batches of pinned uint8 images,
    labels, indices."""
    generator = torch.Generator().manual_seed(7)
    size = plan.micro_slices(0)[0].stop
    return [Batch(torch.randint(0, 256, (size, 32, 32, 3), dtype=torch.uint8, generator=generator).pin_memory(),
                  torch.randint(0, 10, (size,), generator=generator).pin_memory(), torch.arange(size))
            for _ in range(steps * plan.accum)]


def hot_loop(ctx: StepContext, plan: BatchPlan, batches: list[Batch], first_step: int) -> None:
    """The training loop's per-step work (trainer.run_epoch without its log and checkpoint steps)."""
    pending = PendingSteps(GPU)
    for step, micro_batches in enumerate(feed.step_groups(feed.device_batches(batches, GPU), plan.accum),
                                         start=first_step):
        pending.add(train_step(ctx, micro_batches, plan.micro_slices(0), plan.share, 0.1, seed=0, step=step))


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_the_training_loop_never_synchronizes_the_host(amp):
    """The hot loop (mixing, two micro-batches per step, fused SGD, GradScaler under fp16), three ways.
    Sync-debug mode turns every synchronizing call torch makes into an error. The profiler finds no copy from
    pageable memory, which waits for its stream without torch asking (and does find the batches' copies, from
    pinned memory: it sees copies). And one step queued behind a busy kernel returns while that kernel still
    runs. That step has one micro-batch, and its launches are counted first: they must fit CUDA's launch queue
    with room to spare, or the host blocks in a launch, which is no sync of ours (the first GPU run queued two
    steps of two micro-batches behind the kernel and failed that way)."""
    torch.manual_seed(0)
    model = create_model("test_resnet", 10).to(GPU, memory_format=torch.channels_last)
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, GPU)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    ctx = StepContext(model, optimizer, scaler, TrainLoss(0.1), ModelInput(GPU, amp, channels_last=True),
                      mixer=Mixer(0.2, 1.0, 10))
    plan = BatchPlan(16, 1, 8)
    hot_loop(ctx, plan, hot_loop_batches(2, plan), first_step=0)  # warm-up: cuDNN's choices, the allocators
    batches = hot_loop_batches(3, plan)
    assert plan.accum == 2 and len(batches) == 6
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hot_loop(ctx, plan, batches, first_step=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    with profiling() as events:
        hot_loop(ctx, plan, hot_loop_batches(2, plan), first_step=5)
    copies = host_to_device_copies(events)
    assert any(not copy.pageable for copy in copies), f"the profiler saw none of the batches' copies: {copies}"
    pageable = [copy for copy in copies if copy.pageable]
    assert not pageable, f"{len(pageable)} copies from pageable memory in two steps"

    one = BatchPlan(8, 1, 8)  # one micro-batch a step
    with profiling() as events:
        hot_loop(ctx, one, hot_loop_batches(1, one), first_step=7)
    launches = device_work(events)
    assert 0 < launches < LAUNCH_QUEUE * 3 // 4, f"one step launches {launches} kernels and copies: a busy " \
        f"kernel cannot tell a wait for the GPU from a full launch queue (~{LAUNCH_QUEUE})"
    batches = hot_loop_batches(1, one)
    main = busy_training_stream()
    start = time.perf_counter()
    hot_loop(ctx, one, batches, first_step=8)
    seconds = time.perf_counter() - start
    assert not main.query(), f"a training step waited for the GPU: its {launches} launches took the host " \
        f"{seconds:.2f} s, queued behind a kernel of ~2 s"
    torch.cuda.synchronize()


@pytest.mark.parametrize("library", ["torchvision", "nvimgcodec"])
@pytest.mark.parametrize("policy", ["none", "ta_wide"])
def test_the_decode_gpu_feed_never_synchronizes_the_host_nor_copies_from_pageable_memory(jpegs, library, policy):
    """--decode gpu's whole feed (the decoding thread: the library's decode, the canvas, the crops, the policy and
    erasing; then the training stream's wait), under sync-debug mode, which turns every synchronizing call torch
    makes into an error (the decoding thread's errors reach the taker), and under the profiler, which finds no
    copy from pageable memory on any stream: such a copy makes the host wait for its stream without torch asking
    (a nested tensor's padding copied its sizes that way once a batch). Batches of two sizes: a new batch size
    must not change that."""
    if library == "nvimgcodec" and jpeg_decoders.nvimgcodec_unavailable(GPU) is not None:
        pytest.skip(f"nvimgcodec {jpeg_decoders.nvimgcodec_unavailable(GPU)}")
    dataset = pipeline.TrainDataset(jpegs, 120, 4, gpu_decode.encode_bytes, Augment(policy=policy, erase=0.5))
    batches = [gpu_decode.collate([dataset[(e, i)] for i in range(len(jpegs) - e)]).pin_memory() for e in range(3)]
    decoder = gpu_decode.BatchDecoder(GPU, print, jpeg_decoders.JPEG_DECODERS[library].make(GPU, 2))
    expected = [b.images.clone() for b in feed.device_batches(batches, GPU, decoder)]  # warms the library, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        images = [b.images for b in feed.device_batches(batches, GPU, decoder)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(images, expected))
    with profiling() as events:
        images = [b.images for b in feed.device_batches(batches, GPU, decoder)]
    pageable = [copy for copy in host_to_device_copies(events) if copy.pageable]
    assert not pageable, f"{len(pageable)} copies from pageable memory in {len(batches)} batches: {pageable[:3]}"
    assert all(torch.equal(a, b) for a, b in zip(images, expected))


def test_a_compiled_training_loop_never_synchronizes_the_host():
    """The hot loop as the trainer runs it by default on CUDA: the model compiled by inductor (the trainer's
    CompiledOrEager), two micro-batches a step, bf16, under sync-debug mode; and no recompilation after the first
    step (a recompile is a minute of a real model)."""
    from imagenet_elastic.models.compile import CompiledOrEager

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = create_model("test_resnet", 10).to(GPU, memory_format=torch.channels_last)
    compiled = CompiledOrEager(model)
    ctx = StepContext(compiled, create_optimizer(model, 0.1, 0.9, 1e-4, GPU), torch.amp.GradScaler("cuda",
                      enabled=False), TrainLoss(0.1), ModelInput(GPU, torch.bfloat16, channels_last=True))
    plan = BatchPlan(16, 1, 8)
    hot_loop(ctx, plan, hot_loop_batches(2, plan), first_step=0)  # compiles
    assert compiled.failure is None, compiled.failure
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hot_loop(ctx, plan, hot_loop_batches(3, plan), first_step=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "a step after the first recompiled"

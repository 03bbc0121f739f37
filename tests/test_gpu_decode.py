"""`--decode gpu` on the CPU device: the same crops as the worker path, and every fallback said once.

torchvision's batched `decode_jpeg` takes `device="cpu"` as well as CUDA, so everything but nvJPEG
itself runs here; a decoder that refuses chosen images stands in for nvJPEG's limits.
"""

from __future__ import annotations

import contextlib
import io

import inprocess
import numpy as np
import pytest
import torch
from conftest import (
    SMALL_RUN,
    assert_same_tensors,
    load_checkpoint,
    make_image_folder,
    run,
    torchrun_cmd,
)
from PIL import Image
from test_data import write_jpeg
from torch.utils._python_dispatch import TorchDispatchMode

from imagenet_elastic.data import feed, gpu_decode, pipeline, pixels
from imagenet_elastic.data.augment import POLICIES, Augment
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import CorruptImageError

CPU = torch.device("cpu")


@pytest.fixture
def mixed_folder(tmp_path):
    """Nine JPEGs of sizes from 40 to 200 pixels wide, so some crops take DCT scaling on the worker path."""
    root = tmp_path / "train"
    for i in range(9):
        write_jpeg(str(root / f"c{i % 3}" / f"{i}.jpg"), 40 + 20 * i, 200 - 15 * i, seed=i)
    return root


def decoder_and_warnings() -> tuple[gpu_decode.BatchDecoder, list[str]]:
    warnings: list[str] = []
    return gpu_decode.BatchDecoder(CPU, warnings.append), warnings


def batch_of(dataset: pipeline.TrainDataset, keys: list) -> list:
    return gpu_decode.collate([dataset[key] for key in keys])


def test_workers_draw_the_same_crop_and_flip_as_the_cpu_path(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    seen = []

    def spy(raw, name, plan, size):
        with Image.open(io.BytesIO(raw)) as img:
            seen.append(plan(*img.size))

    for epoch in range(3):
        for i in range(len(index)):
            pipeline.TrainDataset(index, 32, seed=5, load=spy)[(epoch, i)]
            encoded = pipeline.TrainDataset(index, 32, seed=5, load=gpu_decode.encode_bytes)[(epoch, i)][0]
            assert (encoded.box, encoded.flip) == seen[-1]
            assert encoded.cpu_reason is None and encoded.data.dim() == 1  # bytes, left to the device


def test_batch_decoder_gives_the_worker_paths_pixels_where_no_dct_scaling_applies(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    size = 120  # DCT scaling needs a crop of 240 pixels: none of these images has one
    keys = [(1, i) for i in range(len(index))]
    decoder, warnings = decoder_and_warnings()
    batch = decoder(batch_of(pipeline.TrainDataset(index, size, 2, gpu_decode.encode_bytes), keys))
    images, targets, indices = batch.images, batch.labels, batch.indices
    expected = torch.stack([pipeline.TrainDataset(index, size, 2)[key][0] for key in keys])
    assert images.dtype == torch.uint8 and images.shape == (len(index), size, size, 3)
    assert torch.equal(images, expected)
    assert targets.tolist() == [int(t) for t in index.labels] and indices.tolist() == list(range(len(index)))
    assert warnings == []


def test_small_crops_differ_from_the_dct_scaled_worker_path_only_by_resampling(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    keys = [(0, i) for i in range(len(index))]
    decoder, _ = decoder_and_warnings()
    images = decoder(batch_of(pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes), keys)).images
    expected = torch.stack([pipeline.TrainDataset(index, 16, 0)[key][0] for key in keys])
    difference = (images.float() - expected.float()).abs().mean(dim=(1, 2, 3))
    assert difference.max() < 12, difference  # the same region; another region of noise differs by ~60


def test_the_device_erases_the_rectangles_the_workers_would_and_leaves_validation_alone(mixed_folder):
    """Erasing is an assignment, so the device's pixels are the worker path's bits, a PNG the worker
    decoded included; the seed drawn after the crop is the only thing the two paths share."""
    Image.fromarray(np.full((50, 60, 3), 9, dtype=np.uint8)).save(mixed_folder / "c0" / "plain.png")
    index = scan_image_folder(str(mixed_folder), "train")
    erase = Augment(erase=1.0)
    keys = [(3, i) for i in range(len(index))]
    warnings: list[str] = []
    decoder = gpu_decode.BatchDecoder(CPU, warnings.append, erase)
    before = torch.get_rng_state()
    images = decoder(batch_of(pipeline.TrainDataset(index, 120, 2, gpu_decode.encode_bytes, erase), keys)).images
    assert torch.equal(torch.get_rng_state(), before)
    expected = torch.stack([pipeline.TrainDataset(index, 120, 2, augment=erase)[key][0] for key in keys])
    assert torch.equal(images, expected)
    plain = torch.stack([pipeline.TrainDataset(index, 120, 2)[key][0] for key in keys])
    assert all(not torch.equal(a, b) for a, b in zip(images, plain))  # p=1: every image has its box
    assert len(warnings) == 1 and "plain.png is a PNG file" in warnings[0]
    val_set = pipeline.EvalDataset(index, 24, 27, gpu_decode.encode_centre_crop)
    val = gpu_decode.collate([val_set[i] for i in range(3)])
    assert torch.equal(decoder(val).images, decoder_and_warnings()[0](val).images)


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_the_device_runs_the_workers_policy_draws_with_torchvisions_tensor_kernels(mixed_folder, policy):
    """Workers run torchvision's PIL kernels, the device its tensor kernels: with the seed each worker
    drew, every image lands within a level of the worker path's, and the policy drawn from other seeds on
    the same crops lands far from it."""
    index = scan_image_folder(str(mixed_folder), "train")
    augment = Augment(policy=policy)
    keys = [(epoch, i) for epoch in range(4) for i in range(len(index))]
    encoded = pipeline.TrainDataset(index, 120, 6, gpu_decode.encode_bytes, augment)
    images = gpu_decode.BatchDecoder(CPU, print, augment)(batch_of(encoded, keys)).images
    crops = [pipeline.TrainDataset(index, 120, 6)[key][0] for key in keys]  # before the policy
    seeds = [encoded[key][0].augment_seed for key in keys]
    assert torch.equal(images, torch.stack([augment.apply(c, s, pil=False) for c, s in zip(crops, seeds)]))
    workers = torch.stack([pipeline.TrainDataset(index, 120, 6, augment=augment)[key][0] for key in keys])
    redrawn = torch.stack([augment.apply(c, 1000 + k, pil=False) for k, c in enumerate(crops)])
    same, other = mean_level_difference(images, workers), mean_level_difference(redrawn, workers)
    assert same.max() < 1.5, same  # measured: at most ~1 level, most images exact
    assert other.mean() > 20, other  # measured: ~45-55


def mean_level_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().mean(dim=(1, 2, 3))


def test_batched_crops_off_the_cpu_give_the_per_image_float_paths_pixels_in_fewer_kernels():
    rng = np.random.default_rng(1)
    shapes = [(90, 70), (64, 120), (33, 33), (200, 150), (48, 40)]
    decoded = [torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]
    boxes = [(3.2, 5.7, 50.0, 60.0), (0, 0, 120, 64), (10, 10, 5, 7), (20.5, 30.25, 100, 140), (0, 0, 40, 48)]
    flips = [True, False, True, False, True]
    one_by_one = []
    for image, box, flip in zip(decoded, boxes, flips):  # what the GPU ran image by image before
        crop = pixels.resize_uint8(pixels.crop_region(image, box), 24, uint8_kernel=False)[0].permute(1, 2, 0)
        one_by_one.append(crop.flip(1) if flip else crop)
    regions = [pixels.crop_region(image, box) for image, box in zip(decoded, boxes)]
    with OpCounter() as batched_ops:
        batched = pixels.resize_regions(regions, flips, 24)
    assert batched.shape == (5, 24, 24, 3) and torch.equal(batched, torch.stack(one_by_one))
    assert batched_ops.count <= 2 * len(regions) + 8, batched_ops.names


def test_the_decoder_crops_a_batch_as_a_gpu_would_within_a_level_of_the_workers_pixels(mixed_folder):
    """The batched float path (what a GPU runs), here on the CPU: flips, fallbacks and positions in place."""
    Image.fromarray(np.full((50, 60, 3), 9, dtype=np.uint8)).save(mixed_folder / "c2" / "plain.png")
    index = scan_image_folder(str(mixed_folder), "train")
    keys = [(e, i) for e in range(3) for i in range(len(index))]
    decoder, _ = decoder_and_warnings()
    decoder.batched_crops = True
    images = decoder(batch_of(pipeline.TrainDataset(index, 120, 8, gpu_decode.encode_bytes), keys)).images
    expected = torch.stack([pipeline.TrainDataset(index, 120, 8)[key][0] for key in keys])
    assert images.shape == expected.shape and (images.int() - expected.int()).abs().max() <= 1
    augment = Augment(policy="ra", erase=0.5)  # the policy on the batched crops' views
    decoder.augment = augment
    images = decoder(batch_of(pipeline.TrainDataset(index, 120, 8, gpu_decode.encode_bytes, augment), keys)).images
    expected = torch.stack([pipeline.TrainDataset(index, 120, 8, augment=augment)[key][0] for key in keys])
    assert mean_level_difference(images, expected).max() < 1.5


class OpCounter(TorchDispatchMode):
    """Operators that reach a device kernel (views excluded): on a GPU, about one launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    @property
    def count(self) -> int:
        return len(self.names)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_batch_crosses_from_a_worker_as_one_tensor_and_decodes_as_in_process(mixed_folder):
    Image.fromarray(np.full((50, 60, 3), 9, dtype=np.uint8)).save(mixed_folder / "c1" / "plain.png")
    index = scan_image_folder(str(mixed_folder), "train")
    dataset = pipeline.TrainDataset(index, 32, 1, gpu_decode.encode_bytes)
    keys = [(0, i) for i in range(len(index))]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[keys], num_workers=1, collate_fn=gpu_decode.collate)
    received = next(iter(loader))
    packed = received.images
    assert isinstance(packed, gpu_decode.EncodedBatch) and packed.data.dim() == 1
    assert all(im.data.numel() == 0 for im in packed.images)  # the bytes travel in `data` alone
    unpacked = packed.unpack()
    for im, key in zip(unpacked, keys):
        alone = dataset[key][0]
        assert torch.equal(im.data, alone.data) and (im.path, im.box, im.flip, im.cpu_reason) == (
            alone.path, alone.box, alone.flip, alone.cpu_reason)
    assert [im.data.dim() for im in unpacked].count(3) == 1  # the PNG's pixels, decoded by the worker
    decoder, _ = decoder_and_warnings()
    assert torch.equal(decoder(received).images, decoder(batch_of(dataset, keys)).images)


def test_png_and_cmyk_jpeg_are_decoded_by_the_worker_and_reported_once_per_kind(tmp_path):
    root = tmp_path / "train"
    noise = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    (root / "a").mkdir(parents=True)
    for name in ("p1.png", "p2.png"):
        Image.fromarray(noise).save(root / "a" / name)
    Image.fromarray(noise).convert("CMYK").save(root / "a" / "k.jpg")
    write_jpeg(str(root / "a" / "rgb.jpg"), 40, 30, seed=1)
    index = scan_image_folder(str(root), "train")
    dataset = pipeline.TrainDataset(index, 24, 0, gpu_decode.encode_bytes)
    encoded = [dataset[(0, i)][0] for i in range(len(index))]
    reasons = {im.path.rsplit("/", 1)[1]: im.cpu_reason for im in encoded}
    assert reasons == {"k.jpg": "a CMYK JPEG", "p1.png": "a PNG file", "p2.png": "a PNG file", "rgb.jpg": None}
    decoder, warnings = decoder_and_warnings()
    images = decoder(batch_of(dataset, [(0, i) for i in range(len(index))])).images
    assert torch.equal(images, torch.stack([pipeline.TrainDataset(index, 24, 0)[(0, i)][0] for i in range(len(index))]))
    decoder(batch_of(dataset, [(1, i) for i in range(len(index))]))
    assert len(warnings) == 2, warnings
    assert "k.jpg is a CMYK JPEG; decoded on the CPU instead" in warnings[0]
    assert "p1.png is a PNG file; decoded on the CPU instead" in warnings[1]


def test_one_decoder_gives_each_batch_the_size_its_worker_asked_for(mixed_folder):
    """Train and val sizes differ under --val-crop-size: the size travels with each image."""
    index = scan_image_folder(str(mixed_folder), "train")
    decoder, _ = decoder_and_warnings()
    train = decoder(batch_of(pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes), [(0, 0), (0, 1)])).images
    val_set = pipeline.EvalDataset(index, 24, 27, gpu_decode.encode_centre_crop)
    val = decoder(gpu_decode.collate([val_set[i] for i in (0, 1)]))
    assert train.shape == (2, 16, 16, 3) and val.images.shape == (2, 24, 24, 3)


class RefusingDecoder(gpu_decode.BatchDecoder):
    """Rejects the images whose bytes are in `refused`, like nvJPEG with a JPEG feature it lacks."""

    def __init__(self, refused: list[torch.Tensor], *args) -> None:
        super().__init__(*args)
        self.refused, self.calls = refused, 0

    def device_decode(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        if any(torch.equal(im, bad) for im in images for bad in self.refused if len(im) == len(bad)):
            raise RuntimeError("nvjpeg: unsupported")
        return super().device_decode(images)


def test_a_jpeg_the_device_decoder_rejects_is_decoded_on_the_cpu_and_reported(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    dataset = pipeline.TrainDataset(index, 20, 3, gpu_decode.encode_bytes)
    keys = [(0, i) for i in range(len(index))]
    batch = batch_of(dataset, keys)
    warnings: list[str] = []
    decoder = RefusingDecoder([batch.images.unpack()[4].data], CPU, warnings.append)
    images = decoder(batch).images
    assert torch.equal(images[4], pipeline.TrainDataset(index, 20, 3)[(0, 4)][0])  # the CPU path's pixels
    assert decoder.calls == 1 + len(index)  # the batch, then each image alone to find the culprit
    assert warnings == [f"--decode gpu: {index.path(4)} is a JPEG the device decoder rejected; decoded on the "
                        "CPU instead (said once for each kind of image)"]


def test_a_truncated_jpeg_is_a_corrupt_image_error_naming_the_file(tmp_path):
    root = tmp_path / "train"
    write_jpeg(str(root / "a" / "ok.jpg"), 40, 30, seed=1)
    cut = root / "a" / "cut.jpg"
    write_jpeg(str(cut), 64, 64, seed=3)
    cut.write_bytes(cut.read_bytes()[:700])  # the header survives: the worker hands it over
    index = scan_image_folder(str(root), "train")
    dataset = pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes)
    decoder, _ = decoder_and_warnings()
    with pytest.raises(CorruptImageError, match="cannot decode image file") as caught:
        decoder(batch_of(dataset, [(0, 0), (0, 1)]))
    assert str(cut) in str(caught.value)


def test_off_the_cpu_the_float_resize_is_within_one_level_of_the_uint8_kernel():
    region = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (1, 3, 90, 70), dtype=np.uint8))
    exact = pixels.resize_uint8(region, 32, uint8_kernel=True)
    via_float = pixels.resize_uint8(region, 32, uint8_kernel=False)
    assert via_float.dtype == torch.uint8 and via_float.shape == exact.shape
    assert (via_float.int() - exact.int()).abs().max() <= 1


def test_training_with_decode_gpu_matches_decode_cpu_step_for_step(image_folder, tmp_path):
    """The fixture's 48x40 images never take DCT scaling at 32 px, so both paths feed identical pixels; random
    erasing (an assignment) draws from the seed each worker handed over and erases the same boxes."""
    args = [str(image_folder), *SMALL_RUN, "--epochs", "1", "--max-steps-per-epoch", "4", "--random-erase", "0.5",
            "--threads", "1", "--workers", "0"]
    cpu = inprocess.command([*args, "--checkpoints-path", str(tmp_path / "cpu")])
    gpu = inprocess.command([*args, "--decode", "gpu", "--checkpoints-path", str(tmp_path / "gpu")])
    assert cpu.returncode == 0, cpu.stderr
    assert gpu.returncode == 0, gpu.stderr
    assert "--decode gpu without a CUDA device" in gpu.stderr
    assert "batched on cpu (--decode gpu), then the policy and erasing there" in gpu.stdout
    cpu_last, gpu_last = load_checkpoint(tmp_path / "cpu" / "last.pt"), load_checkpoint(tmp_path / "gpu" / "last.pt")
    assert_same_tensors(cpu_last["model"], gpu_last["model"])
    assert cpu_last["history"][0]["val_top1"] == gpu_last["history"][0]["val_top1"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_torchrun_each_rank_reports_the_fallbacks_its_own_loader_met(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=8, val_per_class=2)
    for jpeg in (root / "train").rglob("*.jpg"):  # every rank's share is all PNG
        with Image.open(jpeg) as img:
            img.save(jpeg.with_suffix(".png"))
        jpeg.unlink()
    result = run(torchrun_cmd(2, str(root), *SMALL_RUN, "--batch-size", "4", "--epochs", "1", "--decode", "gpu",
                              "--checkpoints-path", str(tmp_path / "ckpt")))
    assert result.returncode == 0, result.stderr
    reports = [line for line in result.stderr.splitlines() if "is a PNG file; decoded on the CPU" in line]
    assert sorted(line.split(":")[1] for line in reports) == [" rank 0", " rank 1"], result.stderr


class ExhaustedDecoder(gpu_decode.BatchDecoder):
    """A device decoder that fails the way torchvision's CUDA decoder does on a full GPU: `error` is a plain
    RuntimeError (torchvision re-throws whatever its decoder raised), or torch's own OutOfMemoryError."""

    def __init__(self, error: Exception, *args) -> None:
        super().__init__(*args)
        self.error, self.calls = error, 0

    def device_decode(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        raise self.error


@pytest.mark.parametrize("error", [
    RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                 "total capacity of 79.19 GiB of which 3.06 MiB is free."),
    RuntimeError("Error while decoding JPEG images: Failed to decode batch: 5"),  # NVJPEG_STATUS_ALLOCATOR_FAILURE
    RuntimeError("Error while decoding JPEG images: Failed to synchronize CUDA stream: 2"),  # cudaErrorMemoryAllocation
    gpu_decode.OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB"),
], ids=["allocator", "nvjpeg_status_5", "cuda_error_2", "torch_oom"])
def test_out_of_memory_in_the_device_decoder_is_raised_not_retried_or_hidden_by_the_cpu_fallback(mixed_folder, error):
    index = scan_image_folder(str(mixed_folder), "train")
    warnings: list[str] = []
    decoder = ExhaustedDecoder(error, CPU, warnings.append)
    with pytest.raises(gpu_decode.OUT_OF_MEMORY) as caught:
        decoder(batch_of(pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes), [(0, 0), (0, 1)]))
    assert decoder.calls == 1 and warnings == []  # not image by image, not on the CPU under a warning
    assert caught.value is error or caught.value.__cause__ is error


@pytest.mark.parametrize("message", ["Error while decoding JPEG images: Failed to decode batch: 3",  # BAD_JPEG
                                     "Error while decoding JPEG images: Failed to get image info: 4",
                                     "Error while decoding JPEG images: Failed to synchronize CUDA stream: 5",
                                     "nvjpeg: unsupported"])
def test_other_device_decoder_failures_are_bad_images_not_out_of_memory(message):
    assert not gpu_decode.device_out_of_memory(RuntimeError(message))


def test_the_policy_runs_on_a_side_stream_that_waits_for_the_decode_alone_and_the_training_stream_waits_for_it(
        mixed_folder, monkeypatch):
    """The design on a CPU (tests/test_cuda.py proves it on a GPU with a busy training stream): each train batch's
    policy and erasing run inside `SideStream.run_after` given the decode thread's event for that batch, then the
    training stream takes the batch; a batch without them (validation) never touches the side stream."""
    index = scan_image_folder(str(mixed_folder), "train")
    augment = Augment(policy="ta_wide", erase=0.5)
    events: list = []
    inside = [False]

    class RecordingStream:
        def __init__(self, device):
            assert device == CPU

        @contextlib.contextmanager
        def run_after(self, ready, tensor):
            events.append(("side stream waits for", ready, tuple(tensor.shape)))
            inside[0] = True
            yield
            inside[0] = False
            events.append("training stream waits for the side stream")

    def ahead(batches, prepare, device, count=2):
        for k, batch in enumerate(batches):
            yield prepare(batch), f"decoded {k}"  # stands for the decode stream's event

    apply = Augment.apply
    monkeypatch.setattr(feed, "SideStream", RecordingStream)
    monkeypatch.setattr(feed, "decoded_ahead", ahead)
    monkeypatch.setattr(feed, "take_on_current_stream", lambda staged, ready, device: events.append(("take", ready)))
    monkeypatch.setattr(Augment, "apply", lambda self, *args, **kw: events.append(("apply", inside[0])) or
                        apply(self, *args, **kw))
    encoded = pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes, augment)
    train = [batch_of(encoded, [(0, 0), (0, 1), (0, 2)]), batch_of(encoded, [(0, 3), (0, 4), (0, 5)])]
    decoder = gpu_decode.BatchDecoder(CPU, print, augment)
    out = list(feed.device_batches(train, CPU, decoder))
    assert len(out) == 2 and all(batch.images.shape == (3, 16, 16, 3) for batch in out)
    for k in range(2):
        block = events[k * 6:(k + 1) * 6]
        assert block == [("side stream waits for", f"decoded {k}", (3, 16, 16, 3)), *[("apply", True)] * 3,
                         "training stream waits for the side stream", ("take", f"decoded {k}")], events
    events.clear()
    val_set = pipeline.EvalDataset(index, 16, 18, gpu_decode.encode_centre_crop)
    val = [gpu_decode.collate([val_set[i] for i in range(3)])]
    assert len(list(feed.device_batches(val, CPU, decoder))) == 1
    assert events == [("take", "decoded 0")]

"""`--decode gpu` run on the CPU's tensors: the same batched path a GPU runs (decode, crops, policy, erasing), against
the per-image reference and the worker path, and every fallback said once.

torchvision's batched `decode_jpeg` takes `device="cpu"` as well as CUDA, so everything but nvJPEG itself runs
here; a decoder that refuses chosen images stands in for nvJPEG's limits.
"""

from __future__ import annotations

import io
import re
import threading

import device_ops
import inprocess
import numpy as np
import pytest
import torch
from conftest import (
    SMALL_RUN,
    assert_names,
    assert_same_tensors,
    load_checkpoint,
    make_image_folder,
    run,
    single_line,
    torchrun_cmd,
)
from device_ops import OpCounter
from makers import write_jpeg
from PIL import Image

from imagenet_elastic.data import pipeline, pixels
from imagenet_elastic.data.augment import POLICIES, Augment
from imagenet_elastic.data.device import feed, gpu_decode, jpeg_decoders
from imagenet_elastic.data.device import streams as stream_factories
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


def batch_of(dataset: pipeline.TrainDataset, keys: list) -> pipeline.Batch:
    return gpu_decode.collate([dataset[key] for key in keys])


def per_image(dataset: pipeline.TrainDataset, keys: list) -> torch.Tensor:
    """The reference crops, image by image: the whole image decoded by libjpeg-turbo, the drawn box cropped, resized
    in float32 and flipped (pixels.resize_uint8 off the CPU's uint8 kernel)."""
    from torchvision.io import decode_jpeg

    out = []
    for key in keys:
        image = dataset[key][0]
        whole = decode_jpeg(image.data).permute(1, 2, 0)
        crop = pixels.resize_uint8(pixels.crop_region(whole, image.box), image.size, uint8_kernel=False)
        crop = crop[0].permute(1, 2, 0)
        out.append(crop.flip(1) if image.flip else crop)
    return torch.stack(out)


def assert_float_rounding_apart(a: torch.Tensor, b: torch.Tensor) -> None:
    """The batched resize adds its products in another order than the per-image one: a pixel that lands on .5 may
    round the other way, nothing more."""
    difference = (a.int() - b.int()).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 1e-4, difference.max()


def policy_per_image(crops: torch.Tensor, dataset: pipeline.TrainDataset, keys: list, augment: Augment):
    """torchvision's tensor kernels of the policy and erasing on each crop, with the seed its worker drew."""
    return torch.stack([augment.apply(crop, dataset[key][0].augment_seed, pil=False) for crop, key in zip(crops, keys)])


def mean_level_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().mean(dim=(1, 2, 3))


def test_workers_draw_the_same_crop_flip_and_policy_as_the_cpu_path(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    seen = []

    def spy(raw, name, plan, size):
        with Image.open(io.BytesIO(raw)) as img:
            seen.append(plan(*img.size))
        return torch.zeros((size, size, 3), dtype=torch.uint8)

    augment = Augment(policy="ra", erase=0.5)
    cpu_path = pipeline.TrainDataset(index, 32, seed=5, load=spy, augment=augment)
    device_path = pipeline.TrainDataset(index, 32, seed=5, load=gpu_decode.encode_bytes, augment=augment)
    for epoch in range(3):
        for i in range(len(index)):
            cpu_path[(epoch, i)]
            encoded = device_path[(epoch, i)][0]
            assert (encoded.box, encoded.flip) == seen[-1]
            assert encoded.cpu_reason is None and encoded.data.dim() == 1  # bytes, left to the device
            assert encoded.draws == augment.draws(encoded.augment_seed, 32) and encoded.draws.ops


def test_the_batched_crops_are_the_per_image_float_path_and_within_a_level_of_the_workers(mixed_folder):
    """Crops of every shape (flips, crops smaller than the output, DCT-free sizes), in one batch."""
    index = scan_image_folder(str(mixed_folder), "train")
    size = 120  # DCT scaling needs a crop of 240 pixels: none of these images has one
    keys = [(e, i) for e in range(3) for i in range(len(index))]
    decoder, warnings = decoder_and_warnings()
    dataset = pipeline.TrainDataset(index, size, 2, gpu_decode.encode_bytes)
    batch = decoder(batch_of(dataset, keys))
    images, targets, indices = batch.images, batch.labels, batch.indices
    assert images.dtype == torch.uint8 and images.shape == (len(keys), size, size, 3) and images.is_contiguous()
    assert_float_rounding_apart(images, per_image(dataset, keys))
    workers = torch.stack([pipeline.TrainDataset(index, size, 2)[key][0] for key in keys])  # the uint8 kernel
    assert (images.int() - workers.int()).abs().max() <= 1
    assert targets.tolist() == [int(index.labels[i]) for _, i in keys] and indices.tolist() == [i for _, i in keys]
    assert warnings == []


def test_small_crops_differ_from_the_dct_scaled_worker_path_only_by_resampling(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    keys = [(0, i) for i in range(len(index))]
    decoder, _ = decoder_and_warnings()
    images = decoder(batch_of(pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes), keys)).images
    expected = torch.stack([pipeline.TrainDataset(index, 16, 0)[key][0] for key in keys])
    difference = mean_level_difference(images, expected)
    assert difference.max() < 12, difference  # the same region; another region of noise differs by ~60


@pytest.mark.parametrize("policy", POLICIES)
def test_the_policy_and_erasing_on_the_batch_are_torchvisions_kernels_with_the_workers_draws(mixed_folder, policy):
    """The device applies each sample's drawn operations to the sub-batch that drew them: on the same crops, the
    pixels of torchvision's tensor kernels image by image, exactly; within a level or so of the workers' path (PIL's
    kernels); far from the same policy drawn from other seeds. torch's global generator does not move."""
    index = scan_image_folder(str(mixed_folder), "train")
    augment = Augment(policy=policy, erase=0.5)
    keys = [(epoch, i) for epoch in range(4) for i in range(len(index))]
    encoded = pipeline.TrainDataset(index, 120, 6, gpu_decode.encode_bytes, augment)
    batch = batch_of(encoded, keys)
    decoder = gpu_decode.BatchDecoder(CPU, print)
    crops = decoder.crops(batch.images)
    before = torch.get_rng_state()
    images = decoder(batch).images
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(images, policy_per_image(crops, encoded, keys, augment))
    workers = torch.stack([pipeline.TrainDataset(index, 120, 6, augment=augment)[key][0] for key in keys])
    same = mean_level_difference(images, workers)
    assert same.max() < 1.5, same  # PIL's kernels and torchvision's differ by about a level at most
    other = policy_per_image(crops, pipeline.TrainDataset(index, 120, 7, gpu_decode.encode_bytes, augment), keys,
                             augment)
    assert mean_level_difference(other, workers).mean() > 10 * same.mean() + 1


def test_validation_batches_take_the_reference_view_within_a_level_of_the_cpu_path(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    decoder, _ = decoder_and_warnings()
    for interpolation in ("bilinear", "bicubic"):
        cpu_set = pipeline.EvalDataset(index, 24, 27, interpolation=interpolation)
        encoded_set = pipeline.EvalDataset(index, 24, 27, gpu_decode.encode_centre_crop, interpolation)
        images = decoder(gpu_decode.collate([encoded_set[i] for i in range(len(index))])).images
        cpu = torch.stack([cpu_set[i][0] for i in range(len(index))])
        # bilinear: the uint8 kernel's rounding; bicubic: its clamping between passes, which noise makes large
        assert mean_level_difference(images, cpu).max() < (0.5 if interpolation == "bilinear" else 3)


def test_a_batch_crosses_from_a_worker_as_columns_and_decodes_as_in_process(mixed_folder):
    Image.fromarray(np.full((50, 60, 3), 9, dtype=np.uint8)).save(mixed_folder / "c1" / "plain.png")
    index = scan_image_folder(str(mixed_folder), "train")
    augment = Augment(policy="ta_wide", erase=0.5)
    dataset = pipeline.TrainDataset(index, 32, 1, gpu_decode.encode_bytes, augment)
    keys = [(0, i) for i in range(len(index))]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[keys], num_workers=1, collate_fn=gpu_decode.collate)
    received = next(iter(loader))
    packed = received.images
    assert isinstance(packed, gpu_decode.EncodedBatch) and packed.data.dim() == 1 and len(packed) == len(index)
    for piece, key in zip(packed.pieces(), keys):
        alone = dataset[key][0]
        assert torch.equal(piece, alone.data.reshape(-1))
    assert list(packed.fallbacks.values()) == ["a PNG file"]  # decoded by the worker
    assert packed.policy is not None and packed.policy.erase is not None
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
    keys = [(0, i) for i in range(len(index))]
    images = decoder(batch_of(dataset, keys)).images
    workers = torch.stack([pipeline.TrainDataset(index, 24, 0)[key][0] for key in keys])
    for i, im in enumerate(encoded):  # the worker's own pixels where it decoded, the batched float path elsewhere
        if im.cpu_reason:
            assert torch.equal(images[i], workers[i]), im.path
        else:
            assert_float_rounding_apart(images[i], per_image(dataset, [keys[i]])[0])
    decoder(batch_of(dataset, [(1, i) for i in range(len(index))]))
    assert len(warnings) == 2, warnings
    assert "k.jpg is a CMYK JPEG; decoded on the CPU instead" in warnings[0]
    assert "p1.png is a PNG file; decoded on the CPU instead" in warnings[1]


def test_one_decoder_gives_each_batch_the_size_its_worker_asked_for(mixed_folder):
    """Train and val sizes differ under --val-crop-size: the size travels with each batch."""
    index = scan_image_folder(str(mixed_folder), "train")
    decoder, _ = decoder_and_warnings()
    train = decoder(batch_of(pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes), [(0, 0), (0, 1)])).images
    val_set = pipeline.EvalDataset(index, 24, 27, gpu_decode.encode_centre_crop)
    val = decoder(gpu_decode.collate([val_set[i] for i in (0, 1)]))
    assert train.shape == (2, 16, 16, 3) and val.images.shape == (2, 24, 24, 3)


class RefusingJpeg(jpeg_decoders.TorchvisionJpeg):
    """Rejects the images whose bytes are in `refused`, like nvJPEG with a JPEG feature it lacks."""

    def __init__(self, refused: list[torch.Tensor]) -> None:
        super().__init__(CPU)
        self.refused, self.calls = refused, 0

    def batch(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        if any(torch.equal(im, bad) for im in images for bad in self.refused if len(im) == len(bad)):
            raise RuntimeError("nvjpeg: unsupported")
        return super().batch(images)


def test_a_jpeg_the_device_decoder_rejects_is_decoded_on_the_cpu_and_reported(mixed_folder):
    index = scan_image_folder(str(mixed_folder), "train")
    augment = Augment(erase=1.0)
    dataset = pipeline.TrainDataset(index, 20, 3, gpu_decode.encode_bytes, augment)
    keys = [(0, i) for i in range(len(index))]
    batch = batch_of(dataset, keys)
    warnings: list[str] = []
    library = RefusingJpeg([batch.images.pieces()[4]])
    decoder = gpu_decode.BatchDecoder(CPU, warnings.append, library)
    images = decoder(batch).images
    assert library.calls == 1 + len(index)  # the batch, then each image alone to find the culprit
    worker_crop = pipeline.TrainDataset(index, 20, 3)[(0, 4)][0]  # the CPU path's crop, then the device's erasing
    assert torch.equal(images[4], augment.apply(worker_crop, dataset[(0, 4)][0].augment_seed, pil=False))
    others = [k for k in range(len(index)) if k != 4]
    crops = decoder.crops(batch_of(dataset, [keys[k] for k in others]).images)
    assert torch.equal(images[others], policy_per_image(crops, dataset, [keys[k] for k in others], augment))
    assert len(warnings) == 1, warnings  # said once: the rejected file, and where it was decoded instead
    assert_names(single_line(warnings[0]), "--decode gpu", index.path(4), "CPU")


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


@pytest.mark.parametrize("policy,erase", [("none", 0.0), ("ta_wide", 0.5), ("imagenet", 0.5)])
def test_the_device_path_dispatches_as_many_operators_for_32_images_as_for_128(mixed_folder, policy, erase):
    """What `bench/benchmark.py --mode device_ops` counts (the decoder's own call apart), constant in the batch size;
    before, it was ~2 operators per image without a policy and ~25 with TrivialAugmentWide (docs/BENCHMARKS.md)."""
    index = scan_image_folder(str(mixed_folder), "train")
    augment = Augment(policy=policy, erase=erase)
    dataset = pipeline.TrainDataset(index, 24, 0, gpu_decode.encode_bytes, augment)
    decoder, _ = decoder_and_warnings()
    keys = [(e, i) for e in range(15) for i in range(len(index))]
    counts = []
    for size in (32, 128):  # 32: enough for nearly every operation the policies draw to appear
        batch = batch_of(dataset, keys[:size])
        decoder(batch)
        counts.append(device_ops.count_batch(decoder, batch))
    assert [c["decoder_calls"] for c in counts] == [1, 1]
    assert counts[1]["ops"] <= 1.2 * counts[0]["ops"], counts


def test_the_training_thread_dispatches_nothing_per_batch_the_two_decoding_threads_do_it_all(mixed_folder):
    """device_batches under --decode gpu: every operator of the decode, crops, policy and erasing runs beside the
    training thread, the decode in one thread and the crops, policy and erasing in another; the thread that
    trains only takes the batches (on a GPU: one event wait and two stream records each)."""
    index = scan_image_folder(str(mixed_folder), "train")
    augment = Augment(policy="ta_wide", erase=0.5)
    dataset = pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes, augment)
    batches = [batch_of(dataset, [(e, i) for i in range(len(index))]) for e in range(3)]
    decoder, _ = decoder_and_warnings()
    threads: dict[str, list] = {"decoded": [], "finished": []}
    decoded, finished = decoder.__class__.decoded, decoder.__class__.finished

    class Recording(gpu_decode.BatchDecoder):
        def decoded(self, batch):
            threads["decoded"].append(threading.current_thread())
            return decoded(self, batch)

        def finished(self, item):
            threads["finished"].append(threading.current_thread())
            return finished(self, item)

    decoder.__class__ = Recording
    with OpCounter() as counter:  # a dispatch mode sees the operators of its own thread
        out = list(feed.device_batches(batches, CPU, decoder))
    assert len(out) == 3 and all(batch.images.shape == (len(index), 16, 16, 3) for batch in out)
    assert counter.count == 0, counter.ops
    assert [len(set(threads[half])) for half in ("decoded", "finished")] == [1, 1]
    assert [len(threads[half]) for half in ("decoded", "finished")] == [3, 3]
    assert threads["decoded"][0] is not threads["finished"][0]
    assert threading.main_thread() not in threads["decoded"] + threads["finished"]


def test_a_loader_without_workers_is_decoded_in_the_training_thread(mixed_folder):
    """--workers 0 reads and draws each sample in the thread that iterates the loader, and the policy's draws seed
    torch's global generator, which the training thread seeds and draws from too (dropout, mixing): beside it, the
    two would interleave and a resumed run would not end where an uninterrupted one does."""
    index = scan_image_folder(str(mixed_folder), "train")
    dataset = pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes, Augment(policy="ra"))
    threads = []

    class Recording(gpu_decode.BatchDecoder):
        def decoded(self, batch):
            threads.append(threading.current_thread())
            return super().decoded(batch)

    for workers in (0, 1):
        loader = pipeline.train_loader(dataset, [[(0, i) for i in range(4)], [(0, i) for i in range(4, 8)]], workers,
                                       False, collate_fn=gpu_decode.collate)
        assert len(list(feed.device_batches(loader, CPU, Recording(CPU, print)))) == 2
        pipeline.stop_loader_workers()
    assert threads[:2] == [threading.main_thread()] * 2 and threading.main_thread() not in threads[2:]


def test_decoded_images_are_held_until_the_kernels_reading_them_have_run():
    """On CUDA nvJPEG may write into memory freed while queued kernels still read it (pytorch/vision#9606); the
    decoder keeps each batch's decoded images until an event after their readers has passed, asking without
    waiting, and waits only when `limit` batches are held."""

    class Event:
        def __init__(self):
            self.done, self.waited = False, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    held = gpu_decode.Held(limit=2)
    events = [Event() for _ in range(4)]
    for k in range(2):
        held.keep([torch.zeros(1)], events[k])
    held.release_finished()
    assert len(held.batches) == 2  # nothing has run: everything stays
    events[0].done = True
    held.release_finished()
    assert len(held.batches) == 1 and not events[0].waited
    held.keep([torch.zeros(1)], events[2])
    held.keep([torch.zeros(1)], events[3])  # a third batch held: the oldest is waited for
    assert events[1].waited and len(held.batches) == 2 and not events[2].waited


def test_training_with_decode_gpu_resumes_mid_epoch_to_the_uninterrupted_bits(image_folder, tmp_path):
    """The device path is a function of the workers' draws: a run stopped in step 2 and resumed ends with the
    weights of the run that never stopped, policy and erasing on. (Its pixels are the batched float path's,
    within a level of --decode cpu's: the two decodes train alike, not bit for bit.)"""
    def args(folder, *extra: str) -> list[str]:
        return [str(image_folder), *SMALL_RUN, "--epochs", "1", "--max-steps-per-epoch", "4", "--random-erase", "0.5",
                "--auto-augment", "ta_wide", "--threads", "1", "--workers", "0", "--decode", "gpu",
                "--checkpoints-path", str(folder), *extra]

    whole = inprocess.command(args(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    assert "--decode gpu without a CUDA device" in whole.stderr
    decode_row = re.search(r"^  decode +(.*)$", whole.stdout, re.MULTILINE).group(1)  # the start-up table's row
    assert_names(decode_row, "cpu", "--decode gpu", "torchvision", "auto", "policy", "erasing")
    stopped = inprocess.train(args(tmp_path / "part"), signal_during_step=2)
    assert stopped.stopped and stopped.saved_at_steps[-1] == 2
    resumed = inprocess.train(args(tmp_path / "part", "--resume"))
    assert not resumed.stopped and resumed.final_step == 4
    final, reference = load_checkpoint(tmp_path / "part" / "last.pt"), load_checkpoint(tmp_path / "whole" / "last.pt")
    assert_same_tensors(final["model"], reference["model"])
    assert final["history"][0]["val_top1"] == reference["history"][0]["val_top1"]


def test_a_run_resumed_with_the_other_decode_warns_once_that_it_no_longer_matches(image_folder, tmp_path):
    """The checkpoint keeps how its run decoded; a resume that decodes otherwise (here --decode cpu after gpu) is one
    warning, as another changed setting is; one that decodes the same way says nothing of it."""
    def args(*extra: str) -> list[str]:
        return [str(image_folder), *SMALL_RUN, "--max-steps-per-epoch", "1", "--threads", "1", "--workers", "0",
                "--checkpoints-path", str(tmp_path), *extra]

    first = inprocess.command(args("--epochs", "1", "--decode", "gpu", "--gpu-decoder", "torchvision"))
    assert first.returncode == 0, first.stderr
    assert load_checkpoint(tmp_path / "last.pt")["decoding"] == {"decode": "gpu", "gpu_decoder": "torchvision"}
    same = inprocess.command(args("--epochs", "2", "--decode", "gpu", "--gpu-decoder", "torchvision", "--resume"))
    assert same.returncode == 0 and "decoding:" not in same.stderr, same.stderr
    other = inprocess.command(args("--epochs", "3", "--decode", "cpu", "--resume"))
    assert other.returncode == 0, other.stderr
    said = [line for line in other.stderr.splitlines() if "decoding:" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), said  # one warning
    # the checkpoint's way, this run's, and the flags that decode as the checkpoint's run did
    assert_names(said[0], "gpu by torchvision", "cpu", "--decode gpu --gpu-decoder torchvision")
    assert load_checkpoint(tmp_path / "last.pt")["decoding"] == {"decode": "cpu"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.usefixtures("warm_ranks")  # the ranks torchrun starts: forks of the warm python
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


class ExhaustedJpeg(jpeg_decoders.TorchvisionJpeg):
    """A device decoder that fails the way torchvision's CUDA decoder does on a full GPU: `error` is a plain
    RuntimeError (torchvision re-throws whatever its decoder raised), or torch's own OutOfMemoryError."""

    def __init__(self, error: Exception) -> None:
        super().__init__(CPU)
        self.error, self.calls = error, 0

    def batch(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        raise self.error


@pytest.mark.parametrize("error", [
    RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                 "total capacity of 79.19 GiB of which 3.06 MiB is free."),
    RuntimeError("Error while decoding JPEG images: Failed to decode batch: 5"),  # NVJPEG_STATUS_ALLOCATOR_FAILURE
    RuntimeError("Error while decoding JPEG images: Failed to synchronize CUDA stream: 2"),  # cudaErrorMemoryAllocation
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
], ids=["allocator", "nvjpeg_status_5", "cuda_error_2", "torch_oom"])
def test_out_of_memory_in_the_device_decoder_is_raised_not_retried_or_hidden_by_the_cpu_fallback(mixed_folder, error):
    index = scan_image_folder(str(mixed_folder), "train")
    warnings: list[str] = []
    library = ExhaustedJpeg(error)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        gpu_decode.BatchDecoder(CPU, warnings.append, library)(
            batch_of(pipeline.TrainDataset(index, 16, 0, gpu_decode.encode_bytes), [(0, 0), (0, 1)]))
    assert library.calls == 1 and warnings == []  # not image by image, not on the CPU under a warning
    assert caught.value is error or caught.value.__cause__ is error


@pytest.mark.parametrize("message", ["Error while decoding JPEG images: Failed to decode batch: 3",  # BAD_JPEG
                                     "Error while decoding JPEG images: Failed to get image info: 4",
                                     "Error while decoding JPEG images: Failed to synchronize CUDA stream: 5",
                                     "nvjpeg: unsupported"])
def test_other_device_decoder_failures_are_bad_images_not_out_of_memory(message):
    assert not jpeg_decoders.device_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize("name", ["feeding_stream", "decoding_stream"])
def test_the_feeding_and_decoding_streams_are_made_once_per_device_at_high_priority(monkeypatch, name):
    """The first GPU run found a stream made at every epoch and every validation pass; each device has one of each."""
    made = []

    class Stream:
        def __init__(self, device, priority=0):
            made.append((device, priority))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    streams = getattr(stream_factories, name)
    streams.cache_clear()
    try:
        first = streams(torch.device("cuda", 0))
        assert streams(torch.device("cuda", 0)) is first
        streams(torch.device("cuda", 1))
        assert made == [(torch.device("cuda", 0), -1), (torch.device("cuda", 1), -1)]
    finally:
        streams.cache_clear()

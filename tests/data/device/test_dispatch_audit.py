"""The dispatch audit (tests/dispatch_audit.py) over the CUDA paths, on a CPU: --decode gpu's device path (the batch
decoder with a stand-in JPEG library, the crops, the policy, device_batches in its two threads and in the training
thread) and the training step (train_step, MicroBatches), with nothing the host waits for and as many operators at
every batch size and decoder layout; each rule failing on a defect of its kind, a host read in either of the two
threads' halves too; and the one fake mode those threads share kept sound (its dispatches one at a time, its
kernel state per thread)."""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Optional

import pytest
import torch
from dispatch_audit import DEVICE, Audit, AuditFailure, FakeCuda, assert_counts_agree, fake_cuda
from torch._subclasses.fake_tensor import in_kernel_invocation_manager

from imagenet_elastic.data import pixels
from imagenet_elastic.data.augment import Draws
from imagenet_elastic.data.device import batch_crops, feed, gpu_decode
from imagenet_elastic.data.device.batch_policy import OPS
from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.models.create import create_model
from imagenet_elastic.optim.optimizer import create_optimizer
from imagenet_elastic.train.micro_batch import MicroBatches
from imagenet_elastic.train.mixing import Mixer
from imagenet_elastic.train.step import StepContext, TrainLoss

SHAPES = [(375, 500), (500, 333), (64, 120), (33, 33), (200, 150), (12, 300), (481, 640)]  # (height, width)
MAGNITUDES = {"ShearX": 0.2, "ShearY": -0.2, "TranslateX": 5.0, "TranslateY": -3.0, "Rotate": 12.0, "Posterize": 4.0,
              "Solarize": 0.5}
SIZE = 32


class StandInJpeg:
    """A JPEG library on the fake device: each image of the batch as a decoder returns it, C x H x W over memory
    in its own layout (`chw`: torchvision's; `hwc`: nvImageCodec's, permuted), made outside the audit as the
    library's one call is."""

    name = "stand-in"

    def __init__(self, cuda: FakeCuda, layout: str) -> None:
        self.cuda, self.layout, self.shapes = cuda, layout, []

    def decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        shapes, self.shapes = self.shapes[:len(data)], self.shapes[len(data):]
        with self.cuda.unaudited():
            if self.layout == "chw":
                return [torch.empty((3, h, w), dtype=torch.uint8, device=DEVICE) for h, w in shapes]
            return [torch.empty((h, w, 3), dtype=torch.uint8, device=DEVICE).permute(2, 0, 1) for h, w in shapes]


def encoded(count: int, seed: int = 0, fallback: bool = False) -> tuple[Batch, list[tuple[int, int]]]:
    """A pinned batch of `count` encoded images of ImageNet's sizes and beyond, every operation of the policies
    drawn at both stages whatever the count (it decides the operators), every other image erased; `fallback`:
    the second one decoded by its worker (a PNG); and the shapes of those the device decodes."""
    rng = random.Random(seed)
    images, shapes = [], []
    for i in range(count):
        height, width = SHAPES[i % len(SHAPES)]
        ops = tuple((OPS[(i + stage) % len(OPS)], MAGNITUDES.get(OPS[(i + stage) % len(OPS)], 0.3))
                    for stage in range(2))
        draws = Draws(ops, (2, 3, 10, 12) if i % 2 else None)
        box = pixels.random_resized_crop_box(width, height, rng)
        image = gpu_decode.EncodedImage(f"{i}.jpg", torch.zeros(64, dtype=torch.uint8), box, bool(i % 3), SIZE,
                                        width, height, augment_seed=i, draws=draws)
        if fallback and i == 1:
            image = replace(image, data=torch.zeros((SIZE, SIZE, 3), dtype=torch.uint8), cpu_reason="a PNG file")
        else:
            shapes.append((height, width))
        images.append(image)
    batch = gpu_decode.collate([(image, i % 10, i) for i, image in enumerate(images)])
    return batch.pin_memory(), shapes


def decoder_on(cuda: FakeCuda, layout: str) -> gpu_decode.BatchDecoder:
    return gpu_decode.BatchDecoder(DEVICE, lambda line: None, StandInJpeg(cuda, layout))


def decode(decoder: gpu_decode.BatchDecoder, batch: Batch, shapes: list[tuple[int, int]]) -> Batch:
    decoder.jpeg.shapes = list(shapes)
    return decoder(batch)


def audited_decoder_ops(count: int, layout: str, fallback: bool = False) -> int:
    """The device operators of one batch through the batch decoder, after a first one that makes what later ones
    reuse (batch_policy's cached tensors)."""
    with fake_cuda() as cuda:
        decoder = decoder_on(cuda, layout)
        with cuda.fake():
            decode(decoder, *encoded(count, seed=1, fallback=fallback))
        batch, shapes = encoded(count, fallback=fallback)
        with cuda.audit() as audit:
            out = decode(decoder, batch, shapes)
        assert out.images.shape == (count, SIZE, SIZE, 3) and out.images.device.type == "cuda"
    return audit.count


def test_the_device_path_waits_for_nothing_in_as_many_operators_for_64_or_256_images_and_either_layout():
    """The batch decoder's crops, policy (every operation at both stages) and erasing: no host wait, and one
    count of device operators (the JPEG library's own call apart) whatever the batch size or the layout the
    library decodes into (torchvision's C x H x W, nvImageCodec's H x W x C)."""
    counts = {(count, layout): audited_decoder_ops(count, layout) for count in (64, 256) for layout in ("chw", "hwc")}
    assert_counts_agree(counts)
    assert 0 < counts[64, "chw"] < 500, counts  # 389 when written


def test_a_batch_with_an_image_its_worker_decoded_waits_for_nothing_either():
    """The fallback's way (pixels from the worker, copied in through pinned memory): a few more operators, as many
    for 64 images as for 256."""
    counts = {count: audited_decoder_ops(count, "hwc", fallback=True) for count in (64, 256)}
    assert_counts_agree(counts)
    assert counts[64] > audited_decoder_ops(64, "hwc"), counts


Plant = Callable[[str, object], None]  # (the half, what it returned): a defect planted after either half


def halves_in_threads(monkeypatch, plant: Optional[Plant] = None) -> dict[str, set[threading.Thread]]:
    """The threads each half of the batch decoder runs in (`decoded`, `finished`), from now on; `plant` runs after
    each half, in its thread."""
    threads: dict[str, set[threading.Thread]] = {"decoded": set(), "finished": set()}

    def spy(half: str) -> Callable:
        original = getattr(gpu_decode.BatchDecoder, half)

        def spied(self: gpu_decode.BatchDecoder, batch: object) -> object:
            threads[half].add(threading.current_thread())
            out = original(self, batch)
            if plant is not None:
                plant(half, out)
            return out
        return spied

    for half in threads:
        monkeypatch.setattr(gpu_decode.BatchDecoder, half, spy(half))
    return threads


def audited_feed(monkeypatch, cuda: FakeCuda, decoder: gpu_decode.BatchDecoder, plant: Optional[Plant] = None
                 ) -> tuple[list[Batch], dict[str, set[threading.Thread]], Audit]:
    """Three batches of 16 through feed.device_batches, audited, after a batch that makes what later ones reuse;
    the threads of each half (`plant` planted after each, from the audited batches on)."""
    with cuda.fake():
        decode(decoder, *encoded(16, seed=1))
    threads = halves_in_threads(monkeypatch, plant)
    made = [encoded(16, seed) for seed in range(3)]
    decoder.jpeg.shapes = [shape for _, shapes in made for shape in shapes]
    with cuda.audit() as audit:
        out = list(feed.device_batches([batch for batch, _ in made], DEVICE, decoder))
    return out, {half: set(ran_in) for half, ran_in in threads.items()}, audit


@pytest.mark.parametrize("thread", ["decoding thread", "training thread"])
def test_device_batches_wait_for_nothing_in_the_decoding_or_the_training_thread(monkeypatch, thread):
    """feed.device_batches under --decode gpu, as loader workers feed it (decoded in two threads of its own, one
    half each: feed.decoded_in_two_threads, their fake dispatches interleaved) and as a loader without workers
    does (decoded in the training thread, where a wait stalls training itself)."""
    monkeypatch.setattr(feed, "reads_in_this_thread", lambda batches: thread == "training thread")
    with fake_cuda() as cuda:
        out, threads, audit = audited_feed(monkeypatch, cuda, decoder_on(cuda, "hwc"))
    assert len(out) == 3 and all(batch.images.shape == (16, SIZE, SIZE, 3) for batch in out)
    assert audit.count == 3 * audited_decoder_ops(16, "hwc"), audit.ops
    if thread == "training thread":
        assert threads == {"decoded": {threading.main_thread()}, "finished": {threading.main_thread()}}
    else:  # the real two-thread feed was audited: one thread per half, neither the training thread
        (first,), (second,) = threads["decoded"], threads["finished"]
        assert len({first, second, threading.main_thread()}) == 3, threads


def first_half_reads_an_image(half: str, out: object) -> None:
    """`decoded` reads its first image's brightness on the host (a log line): a wait for the decode."""
    if half == "decoded":
        out[1][0].float().mean().item()


def test_a_host_read_in_the_first_threads_half_fails_the_audit(monkeypatch):
    """The defect in feed's first thread (BatchDecoder.decoded, on the decoding stream): it fails there, at its
    operator, and reaches the training thread through the second thread."""
    failed_in: list[threading.Thread] = []

    def plant(half: str, out: object) -> None:
        try:
            first_half_reads_an_image(half, out)
        except AuditFailure:
            failed_in.append(threading.current_thread())
            raise

    with fake_cuda() as cuda:
        decoder = decoder_on(cuda, "hwc")
        with pytest.raises(AuditFailure, match="_local_scalar_dense.*the host reads a device value"):
            audited_feed(monkeypatch, cuda, decoder, plant)
    assert failed_in and failed_in[0] is not threading.main_thread() and failed_in[0].name == "decode-ahead"


class PausedJpeg(StandInJpeg):
    """The stand-in library whose second call in a thread of feed's (the decoding thread's, for the second batch)
    stays inside its unaudited call until the other thread has finished the first batch."""

    def __init__(self, cuda: FakeCuda, layout: str) -> None:
        super().__init__(cuda, layout)
        self.calls, self.inside, self.finished = 0, threading.Event(), threading.Event()

    def decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += threading.current_thread() is not threading.main_thread()
        with self.cuda.unaudited():
            if self.calls == 2:
                self.inside.set()
                self.finished.wait(timeout=60)
            return super().decode(data)


def test_a_host_read_in_the_second_threads_half_fails_the_audit_while_the_first_thread_is_paused(monkeypatch):
    """The defect in feed's second thread (BatchDecoder.finished reads the batch's brightness: `.item()`), made
    while the first thread is inside the JPEG library's unaudited call: the pause is that thread's alone."""
    failed_in: list[threading.Thread] = []
    with fake_cuda() as cuda:
        jpeg = PausedJpeg(cuda, "hwc")
        decoder = gpu_decode.BatchDecoder(DEVICE, lambda line: None, jpeg)

        def plant(half: str, out: object) -> None:
            if half != "finished":
                return
            try:
                assert jpeg.inside.wait(timeout=60), "the first thread never reached the library's second call"
                out.images.float().mean().item()
            except AuditFailure:
                failed_in.append(threading.current_thread())
                raise
            finally:
                jpeg.finished.set()

        with pytest.raises(AuditFailure, match="_local_scalar_dense.*the host reads a device value"):
            audited_feed(monkeypatch, cuda, decoder, plant)
    assert failed_in and failed_in[0] is not threading.main_thread() and failed_in[0].name == "decode-ahead"
    assert jpeg.inside.is_set() and jpeg.calls >= 2


def test_a_thread_inside_a_fake_kernel_leaves_the_other_threads_tensors_on_the_device():
    """FakeTensorMode's kernel state is per thread here: while one thread is inside a fake kernel (its tensors on
    `meta`, as every fake dispatch puts them), another thread's `.device` and operators see the device."""
    seen = []
    with fake_cuda() as cuda, cuda.audit():
        x = device_tensor()
        with in_kernel_invocation_manager(cuda.mode):
            assert x.device.type == "meta"
            thread = feed.threading.Thread(target=lambda: seen.append((x.device.type, (x + 1).device.type)))
            thread.start()
            thread.join()
    assert seen == [("cuda", "cuda")]


def test_the_fake_dispatches_of_feeds_threads_run_one_at_a_time():
    """A fake dispatch in another thread waits for the lock that one in progress holds (cuda.lock here)."""
    ready, go, done = threading.Event(), threading.Event(), threading.Event()

    def add() -> None:
        ready.set()  # its modes entered
        go.wait(60)
        x + 1
        done.set()

    with fake_cuda() as cuda, cuda.audit() as audit:
        x = device_tensor()
        thread = feed.threading.Thread(target=add)
        thread.start()
        assert ready.wait(60)
        with cuda.lock:
            go.set()
            assert not done.wait(0.5)
        assert done.wait(60)
        thread.join()
    assert audit.ops["aten.add.Tensor"] == 1, audit.ops


def step_batches(plan: BatchPlan, seed: int) -> list[Batch]:
    """A step's micro-batches as the loader hands them over under --decode cpu: pinned uint8 images, labels."""
    generator = torch.Generator().manual_seed(seed)
    return [Batch(torch.randint(0, 256, (part.stop - part.start, SIZE, SIZE, 3), dtype=torch.uint8,
                                generator=generator), torch.randint(0, 10, (part.stop - part.start,),
                                                                    generator=generator)).pin_memory()
            for part in plan.micro_slices(0)]


def step_context(model: torch.nn.Module) -> StepContext:
    """The hot loop's settings on the device (`model` made on the host): channels_last, float16 autocast and its
    GradScaler, mixing, fused SGD, a clipped gradient."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # fake tensors are not swapped into parameters
    try:
        model = model.to(DEVICE, memory_format=torch.channels_last)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, DEVICE)
    return StepContext(model, optimizer, torch.amp.GradScaler("cuda"), TrainLoss(0.1),
                       ModelInput(DEVICE, torch.float16, channels_last=True), mixer=Mixer(0.2, 1.0, 10),
                       clip_grad_norm=1.0)


def audited_step_ops(micro_batch: int, auto: bool = False, criterion: Optional[torch.nn.Module] = None) -> int:
    """One step of two micro-batches, their copies to the device included (feed.device_batches); `auto`: as
    --micro-batch auto runs it (MicroBatches.attempt, the buffers' copy)."""
    plan = BatchPlan(2 * micro_batch, 1, micro_batch)
    torch.manual_seed(0)
    model = create_model("test_resnet", 10)
    with fake_cuda() as cuda:
        with cuda.fake():
            ctx = step_context(model)
            steps = MicroBatches(plan, micro_batch, 0, auto=auto)
            steps.step(ctx, list(feed.device_batches(step_batches(plan, 0), DEVICE)), 0.1, seed=0, step=0)
        batches = step_batches(plan, 1)
        ctx.criterion = criterion or ctx.criterion
        with cuda.audit() as audit:
            loss = steps.step(ctx, list(feed.device_batches(batches, DEVICE)), 0.1, seed=0, step=1)
    assert loss.device.type == "cuda" and loss.shape == (1,)
    return audit.count


def test_a_training_step_waits_for_nothing_in_as_many_operators_for_micro_batches_of_8_or_32():
    """train_step and MicroBatches (plain and --micro-batch auto's attempt), as the hot loop runs them on a GPU:
    no host wait in the copies, mixing, float16 autocast, GradScaler, clipping or fused SGD (the backward
    pass's own kernels apart: see dispatch_audit.FakeCuda.backward), and one count at both sizes."""
    counts = {(size, auto): audited_step_ops(size, auto) for size in (8, 32) for auto in (False, True)}
    assert_counts_agree({size: counts[size, False] for size in (8, 32)})
    assert_counts_agree({size: counts[size, True] for size in (8, 32)})
    assert counts[8, True] > counts[8, False], counts  # the buffers' copy before the attempt


# ---------------------------------------------------------------- each rule, on a defect of its kind


def device_tensor() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 12, device=DEVICE)


@pytest.mark.parametrize("read", ["item", "bool", "int", "tolist", "equal"])
def test_reading_a_device_value_on_the_host_fails_the_audit(read):
    with fake_cuda() as cuda, cuda.audit():
        x = device_tensor()
        with pytest.raises(AuditFailure, match="the host reads a device value"):
            {"item": lambda: x.sum().item(), "bool": lambda: bool(x.sum() > 0), "int": lambda: int(x.sum()),
             "tolist": x.tolist, "equal": lambda: torch.equal(x, x)}[read]()


class LoggedLoss(torch.nn.Module):
    """A loss that keeps its values on the host as it goes: the step's defect of old, .item() each micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.loss, self.values = TrainLoss(0.1), []

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss(logits, targets)
        self.values.append(loss.item())
        return loss


def test_a_step_that_reads_its_loss_on_the_host_fails_the_audit():
    with pytest.raises(AuditFailure, match="_local_scalar_dense.*the host reads a device value"):
        audited_step_ops(8, criterion=LoggedLoss())


COPIES = {
    "from pageable memory": lambda: torch.zeros(3).to(DEVICE, non_blocking=True),
    "into a device tensor from pageable memory": lambda: torch.empty(3, device=DEVICE).copy_(torch.zeros(3), True),
    "a list made on the device": lambda: torch.tensor([1.0, 2.0], device=DEVICE),
    "pinned, but blocking": lambda: torch.zeros(3).pin_memory().to(DEVICE),
    "to the host": lambda: device_tensor().cpu(),
}


@pytest.mark.parametrize("copy", COPIES)
def test_a_copy_that_waits_fails_the_audit(copy):
    with fake_cuda() as cuda, cuda.audit(), pytest.raises(AuditFailure, match="copy to the"):
        COPIES[copy]()


def test_copies_from_pinned_memory_and_its_views_without_blocking_pass_the_audit():
    with fake_cuda() as cuda, cuda.audit() as audit:
        pinned = torch.arange(12).pin_memory()
        assert pinned.is_pinned() and not torch.arange(3).is_pinned()
        pinned.to(DEVICE, non_blocking=True)
        pinned[4:].view(2, 4).to(DEVICE, non_blocking=True)
        torch.empty(12, device=DEVICE).copy_(pinned, non_blocking=True)
        device_tensor().to("cpu", non_blocking=True)  # into memory torch pins for it
    assert audit.count == 6, audit.ops  # three copies in, the linspace, its copy out, the empty


SYNCHRONIZING = {
    "nonzero": lambda x: x.nonzero(),
    "a boolean mask": lambda x: x[x > 0],
    "masked_select": lambda x: x.masked_select(x > 0),
    "unique": lambda x: x.unique(),
    "repeat_interleave without output_size": lambda x: x.repeat_interleave(torch.ones(12, device=DEVICE).long()),
    "a boolean mask's put of a device tensor": lambda x: x.index_put_((x > 0,), x.flip(0)),
    "bincount": lambda x: x.long().abs().bincount(),
    "to_padded_tensor": lambda x: torch.ops.aten.to_padded_tensor(x, 0.0),
}


@pytest.mark.parametrize("op", SYNCHRONIZING)
def test_an_operator_that_synchronizes_fails_the_audit(op):
    with fake_cuda() as cuda, cuda.audit(), pytest.raises(AuditFailure):
        SYNCHRONIZING[op](device_tensor())


def test_their_waitless_forms_pass_the_audit():
    with fake_cuda() as cuda, cuda.audit():
        x = device_tensor()
        x.repeat_interleave(torch.ones(12, device=DEVICE).long(), output_size=12)
        x[x > 0] = 0.0  # masked_fill_
        torch.where(x > 0, x, 0.0)


@pytest.mark.parametrize("wait", ["torch.cuda.synchronize", "Stream.synchronize", "Event.synchronize"])
def test_an_explicit_wait_fails_the_audit(wait):
    with fake_cuda() as cuda, cuda.audit(), pytest.raises(AuditFailure, match=wait):
        {"torch.cuda.synchronize": torch.cuda.synchronize,
         "Stream.synchronize": lambda: torch.cuda.current_stream().synchronize(),
         "Event.synchronize": lambda: torch.cuda.current_stream().record_event().synchronize()}[wait]()


def nested_canvas(images, height, width):
    """The canvas as it was built before: a nested tensor padded by to_padded_tensor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.as_nested_tensor(list(images))
    return nested.to(torch.float32).to_padded_tensor(0.0, output_size=(len(images), 3, height, width))


def audited_crops(layout: str = "chw") -> int:
    """crop_resize alone, on images of ImageNet's sizes and beyond as the JPEG library leaves them."""
    with fake_cuda() as cuda, cuda.audit() as audit:
        jpeg = StandInJpeg(cuda, layout)
        jpeg.shapes = SHAPES
        views = torch.zeros(len(SHAPES), batch_crops.VIEW_FIELDS, device=DEVICE)
        assert batch_crops.crop_resize(jpeg.decode([None] * len(SHAPES)), views, SIZE).shape == (7, SIZE, SIZE, 3)
    return audit.count


def test_the_crops_gather_their_canvas_without_a_host_wait_in_either_layout():
    assert_counts_agree({layout: audited_crops(layout) for layout in ("chw", "hwc")})


def test_the_nested_tensor_canvas_fails_the_audit(monkeypatch):
    monkeypatch.setattr(batch_crops, "padded_canvas", nested_canvas)
    with pytest.raises(AuditFailure, match="nested tensor"):
        audited_crops()


def per_image_crops(crop_resize):
    def crops(images, views, size, interpolation="bilinear"):
        return torch.cat([crop_resize([image], views[i:i + 1], size, interpolation) for i, image in enumerate(images)])
    return crops


def each_made_contiguous(padded_canvas):
    def canvas(images, height, width):
        return padded_canvas([image.contiguous() for image in images], height, width)
    return canvas


@pytest.mark.parametrize("defect", ["crops image by image", "a copy of each image not in C x H x W"])
def test_work_per_image_or_per_layout_fails_the_audits_count(monkeypatch, defect):
    if defect == "crops image by image":
        monkeypatch.setattr(batch_crops, "crop_resize", per_image_crops(batch_crops.crop_resize))
    else:
        monkeypatch.setattr(batch_crops, "padded_canvas", each_made_contiguous(batch_crops.padded_canvas))
    counts = {(count, layout): audited_decoder_ops(count, layout) for count in (8, 16) for layout in ("chw", "hwc")}
    with pytest.raises(AuditFailure, match="operators on the device differ"):
        assert_counts_agree(counts)

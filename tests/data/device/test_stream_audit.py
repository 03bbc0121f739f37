"""The stream-discipline audit (tests/stream_audit.py): --decode gpu's two threads, run on CPU tensors as they run
on CUDA, keep the order CUDA needs between their streams, with each JPEG library, whether the device keeps up or
lags; and each rule catches a defect of its kind planted in the real code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from makers import write_jpeg
from PIL import Image
from stream_audit import BLOCKS, FINISHED, HELD, RECORDED, StreamAudit

from imagenet_elastic.data import pipeline
from imagenet_elastic.data.augment import Augment
from imagenet_elastic.data.device import feed, gpu_decode, jpeg_decoders, streams
from imagenet_elastic.data.sources.image_folder import scan_image_folder

CPU = torch.device("cpu")
LIBRARIES = list(jpeg_decoders.JPEG_DECODERS)
NO_LAG, LAGGING = 0, 100  # events complete at once; only when the host waits for them (Held's limit is reached)


@pytest.fixture(scope="module")
def batches(tmp_path_factory) -> list[pipeline.Batch]:
    """Six batches of JPEGs and a PNG (decoded by the worker: the batch decoder's copy of CPU pixels runs too),
    with a policy and erasing."""
    root = tmp_path_factory.mktemp("audit") / "train"
    for i in range(5):
        write_jpeg(str(root / f"c{i % 2}" / f"{i}.jpg"), 40 + 10 * i, 70 - 5 * i, seed=i)
    Image.fromarray(np.full((30, 40, 3), 90, dtype=np.uint8)).save(root / "c0" / "plain.png")
    index = scan_image_folder(str(root), "train")
    dataset = pipeline.TrainDataset(index, 24, 0, gpu_decode.encode_bytes, Augment(policy="ta_wide", erase=0.5))
    return [gpu_decode.collate([dataset[(epoch, i)] for i in range(len(index))]) for epoch in range(6)]


def audited(monkeypatch, batches: list[pipeline.Batch], library: str, lag: int = NO_LAG, plant=None) -> StreamAudit:
    """The batches through feed.device_batches as on CUDA, the training thread using each one on its stream."""
    audit = StreamAudit(lag)
    audit.install(monkeypatch)
    if plant is not None:
        plant(monkeypatch, audit)
    jpeg = jpeg_decoders.JPEG_DECODERS[library].make(CPU, 1)
    audit.track_decoder(jpeg)
    decoder = gpu_decode.BatchDecoder(CPU, lambda line: None, jpeg)
    taken = 0
    with audit.recording():
        for batch in feed.device_batches(batches, CPU, decoder):
            audit.delivered(batch.images, batch.labels)
            batch.images.float().mean()  # the training step's first use, on the training stream
            batch.labels.sum()
            taken += 1
    audit.close()  # the last batches Held keeps go with the decoder
    assert taken == len(batches)
    return audit


@pytest.mark.parametrize("lag", [NO_LAG, LAGGING], ids=["device_keeps_up", "device_lags"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_decode_gpu_keeps_the_order_cuda_needs_between_its_threads_and_streams(monkeypatch, batches, library, lag):
    audit = audited(monkeypatch, batches, library, lag)
    assert audit.violations == []
    used = {stream for stream in audit.streams if stream.clock[stream] > 0}
    assert len(used) >= 3, used  # the decoding, feeding and training streams all ran work
    if lag == LAGGING:  # Held's limit was reached: the host waited for the oldest crops' event
        assert audit.observed


# ----------------------------------------------------------------------------- each rule fails on its defect


def no_wait_for_the_decode(monkeypatch, audit):
    """The crops are queued without their stream waiting for the decoded batch's event."""
    monkeypatch.setattr(feed, "after_event", lambda prepare, device: lambda item: prepare(item[0]))


def decoded_on_another_stream(monkeypatch, audit):
    """The batch is handed over with an event recorded before it was made: decoded on a stream other than the
    one whose event goes with it."""
    decoded, elsewhere = gpu_decode.BatchDecoder.decoded, torch.cuda.Stream()

    def on_another(self, batch):
        with torch.cuda.stream(elsewhere):
            return decoded(self, batch)

    monkeypatch.setattr(gpu_decode.BatchDecoder, "decoded", on_another)


def taken_without_waiting(monkeypatch, audit):
    """The training stream uses the batch without waiting for its ready event."""
    def take(staged, ready, device):
        for tensor in (staged.images, staged.labels):
            tensor.record_stream(torch.cuda.current_stream(device))

    monkeypatch.setattr(feed, "take_on_current_stream", take)


def taken_without_record_stream(monkeypatch, audit):
    """The training stream waits for the batch, but its tensors are not recorded on it."""
    monkeypatch.setattr(feed, "take_on_current_stream",
                        lambda staged, ready, device: torch.cuda.current_stream(device).wait_event(ready))


def not_held(monkeypatch, audit):
    """The decoded images go as soon as their crops are queued."""
    monkeypatch.setattr(gpu_decode.BatchDecoder, "hold", lambda self, decoded: None)


def held_until_the_wrong_event(monkeypatch, audit):
    """The decoded images are held until an event of the decoding stream, which says nothing of the crops."""
    def hold(self, decoded):
        event = torch.cuda.Event(blocking=True)
        streams.decoding_stream(self.device).record_event(event)
        self.held.keep(decoded, event)

    monkeypatch.setattr(gpu_decode.BatchDecoder, "hold", hold)


def held_by_a_spinning_event(monkeypatch, audit):
    """Held's event made without blocking=True: the host spins while it waits at Held's limit."""
    def hold(self, decoded):
        self.held.keep(decoded, torch.cuda.current_stream(self.device).record_event())

    monkeypatch.setattr(gpu_decode.BatchDecoder, "hold", hold)


@pytest.mark.parametrize("plant,rule,lag", [
    (no_wait_for_the_decode, FINISHED, NO_LAG),
    (decoded_on_another_stream, FINISHED, NO_LAG),
    (taken_without_waiting, FINISHED, NO_LAG),
    (taken_without_record_stream, RECORDED, NO_LAG),
    (not_held, HELD, NO_LAG),
    (held_until_the_wrong_event, HELD, NO_LAG),
    (held_by_a_spinning_event, BLOCKS, LAGGING),
], ids=lambda value: getattr(value, "__name__", str(value)))
@pytest.mark.parametrize("library", LIBRARIES)
def test_each_rule_of_the_audit_fails_on_a_defect_of_its_kind(monkeypatch, batches, library, plant, rule, lag):
    assert rule in audited(monkeypatch, batches, library, lag, plant).rules_broken()


def test_torchvision_waits_without_spinning_for_what_else_is_queued_on_its_allocation_stream(monkeypatch, batches):
    """torch hands out pooled streams round robin: another part of the process may queue work on the stream
    torchvision's outputs are allocated on, and free memory that work still reads, which torchvision's own stream
    would then write over. Before each decode the host sees that stream's queue done (an event, blocking)."""
    audit = StreamAudit()
    audit.install(monkeypatch)
    jpeg = jpeg_decoders.TorchvisionJpeg(CPU)
    with audit.recording():
        with torch.cuda.stream(jpeg.alloc_stream):
            torch.ones(8).mul(2)  # someone else's kernel on the same pooled stream
        queued = jpeg.alloc_stream.clock[jpeg.alloc_stream]
        images = jpeg.decode(list(batches[0].images.pieces()[:2]))
    assert len(images) == 2 and all(image is not None for image in images)
    assert any(clock.get(jpeg.alloc_stream, 0) >= queued for clock in audit.observed)
    assert audit.violations == []

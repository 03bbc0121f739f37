"""`feed.decoded_ahead`: --decode gpu's thread that decodes ahead of the training thread; two of them in a chain
(`feed.decoded_in_two_threads`): one decodes the next batch while the other queues the current one's crops."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from imagenet_elastic.data.feed import decoded_ahead, decoded_in_two_threads
from imagenet_elastic.errors import CorruptImageError

CPU = torch.device("cpu")


def decode_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "decode-ahead"]


class Source:
    """Batches 0, 1, 2, ... that remember how many were taken and by which thread."""

    def __init__(self, count: int) -> None:
        self.count, self.taken, self.threads = count, 0, set()

    def __iter__(self):
        for i in range(self.count):
            self.taken += 1
            self.threads.add(threading.current_thread().name)
            yield [torch.tensor([i])]


def test_every_batch_comes_in_order_prepared_by_a_thread_of_its_own():
    source = Source(7)
    out = [staged[0].item() for staged, ready in decoded_ahead(source, lambda b: [b[0] * 10], CPU) if ready is None]
    assert out == [0, 10, 20, 30, 40, 50, 60]
    assert source.threads == {"decode-ahead"}
    assert decode_threads() == []  # ended with the batches


def test_it_runs_at_most_a_few_batches_ahead_and_closing_it_stops_and_joins_the_thread():
    source = Source(100)
    batches = decoded_ahead(source, lambda b: b, CPU, ahead=2)
    next(batches)
    time.sleep(0.5)  # time to run ahead as far as it may
    assert source.taken <= 1 + 2 + 1  # the one taken, two waiting, one in hand
    batches.close()
    assert decode_threads() == []
    assert source.taken <= 4


def test_an_error_in_the_thread_is_raised_in_the_taking_thread_after_the_batches_before_it():
    def prepare(batch: list) -> list:
        if batch[0].item() == 3:
            raise CorruptImageError("cannot decode image file /data/x.jpg: truncated")
        return batch

    taken = []
    with pytest.raises(CorruptImageError, match="^cannot decode image file /data/x.jpg: truncated$"):
        for staged, _ in decoded_ahead(Source(10), prepare, CPU):
            taken.append(staged[0].item())
    assert taken == [0, 1, 2]
    assert decode_threads() == []


class Halves:
    """A batch decoder's two halves (gpu_decode.BatchDecoder.decoded, .finished) that record which thread ran
    each batch's half, and fail at `failing` = (half, batch)."""

    def __init__(self, failing: tuple[str, int] = ("", -1)) -> None:
        self.failing, self.threads = failing, {"decoded": {}, "finished": {}}

    def run(self, half: str, k: int) -> None:
        self.threads[half][k] = threading.current_thread()
        if self.failing == (half, k):
            raise CorruptImageError(f"cannot decode image file /data/{k}.jpg: truncated")

    def decoded(self, batch: list) -> tuple[int, str]:
        k = batch[0].item()
        self.run("decoded", k)
        return k, "decoded"

    def finished(self, item: tuple[int, str]) -> tuple[int, str]:
        self.run("finished", item[0])
        return item[0], "finished"


def test_the_next_batch_is_decoded_while_the_current_ones_crops_are_queued():
    """The JPEG libraries hold their calling thread for the decode (torchvision for the device's whole decode):
    in one thread the crops of batch k would wait for that. Here batch k's second half does not return before
    batch k + 1's decode has begun, and that decode not before batch k's second half has begun: one thread
    would wait out each timeout."""
    began = {half: [threading.Event() for _ in range(5)] for half in ("decoded", "finished")}
    overlapped = []

    class Waiting(Halves):
        def decoded(self, batch):
            k = batch[0].item()
            began["decoded"][k].set()
            if k > 0:
                overlapped.append(began["finished"][k - 1].wait(timeout=2))
            return super().decoded(batch)

        def finished(self, item):
            k = item[0]
            began["finished"][k].set()
            if k < 4:
                overlapped.append(began["decoded"][k + 1].wait(timeout=2))
            return super().finished(item)

    out = [staged for staged, _ in decoded_in_two_threads(Source(5), Waiting(), CPU)]
    assert out == [(k, "finished") for k in range(5)]
    assert overlapped == [True] * 8


def test_the_two_halves_run_in_two_threads_of_their_own_and_the_loader_is_read_by_the_first_alone():
    source, halves = Source(6), Halves()
    out = [staged for staged, ready in decoded_in_two_threads(source, halves, CPU) if ready is None]
    assert out == [(k, "finished") for k in range(6)]
    decoding, finishing = (set(halves.threads[half].values()) for half in ("decoded", "finished"))
    assert len(decoding) == len(finishing) == 1 and decoding != finishing
    assert source.threads == {"decode-ahead"} and {t.name for t in decoding} == {"decode-ahead"}
    assert threading.main_thread() not in decoding | finishing
    assert decode_threads() == []


@pytest.mark.parametrize("half", ["decoded", "finished"])
def test_an_error_in_either_half_is_raised_in_the_taking_thread_after_the_batches_before_it(half):
    taken = []
    with pytest.raises(CorruptImageError, match="^cannot decode image file /data/3.jpg: truncated$"):
        for staged, _ in decoded_in_two_threads(Source(10), Halves(failing=(half, 3)), CPU):
            taken.append(staged[0])
    assert taken == [0, 1, 2]
    assert decode_threads() == []


def test_closing_the_two_threads_stops_both_and_takes_no_further_batch_from_the_loader():
    source = Source(100)
    batches = decoded_in_two_threads(source, Halves(), CPU)
    next(batches)
    time.sleep(0.5)  # time to run ahead as far as they may
    assert len(decode_threads()) == 2
    taken = source.taken
    assert taken <= 1 + (2 + 1) + (1 + 1)  # the one taken; the second half's two waiting and one in hand; the first's
    batches.close()
    assert decode_threads() == []
    assert source.taken <= taken + 1

"""`feed.decoded_ahead`: --decode gpu's thread that decodes ahead of the training thread; a batch that runs out of
device memory there (or in the training thread, `feed.prepared`), told to the training thread and decoded again."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from imagenet_elastic.data.feed import decoded_ahead, prepared
from imagenet_elastic.errors import CorruptImageError, UserError

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


class RunsOutOfMemory:
    """A stand-in decoder: the device's out-of-memory error for the batches numbered in `failing`, as often as listed
    there; every call recorded."""

    def __init__(self, *failing: int) -> None:
        self.failing, self.calls = list(failing), []

    def __call__(self, batch: list) -> list:
        number = batch[0].item()
        self.calls.append(number)
        if number in self.failing:
            self.failing.remove(number)
            raise torch.OutOfMemoryError(f"CUDA out of memory decoding batch {number} (injected)")
        return batch


@pytest.mark.parametrize("threaded", [True, False])
def test_a_batch_that_ran_out_of_memory_is_told_in_order_and_decoded_again_none_lost_or_repeated(threaded):
    told, decoder = [], RunsOutOfMemory(3)

    def out_of_memory(batch: list, line: str, again: bool) -> None:
        told.append((batch[0].item(), line, again, list(taken)))

    taken: list[int] = []
    if threaded:
        batches = (staged for staged, _ in decoded_ahead(Source(6), decoder, CPU, out_of_memory=out_of_memory))
    else:  # --workers 0: the training thread decodes (feed.device_batches)
        batches = (prepared(decoder, batch, out_of_memory, CPU) for batch in Source(6))
    for staged in batches:
        taken.append(staged[0].item())
    assert taken == [0, 1, 2, 3, 4, 5]
    assert told == [(3, "CUDA out of memory decoding batch 3 (injected)", False, [0, 1, 2])]  # after the ones before
    assert decoder.calls == [0, 1, 2, 3, 3, 4, 5]
    assert decode_threads() == []


def test_a_batch_that_runs_out_of_memory_again_is_told_so_and_what_the_taker_raises_ends_the_thread():
    told = []

    def out_of_memory(batch: list, line: str, again: bool) -> None:
        told.append(again)
        if again:
            raise UserError("out of memory again")

    with pytest.raises(UserError, match="^out of memory again$"):
        for _ in decoded_ahead(Source(100), RunsOutOfMemory(1, 1), CPU, out_of_memory=out_of_memory):
            pass
    assert told == [False, True] and decode_threads() == []


def test_without_a_policy_an_out_of_memory_error_is_raised_as_it_came():
    with pytest.raises(torch.OutOfMemoryError, match="decoding batch 2"):
        list(decoded_ahead(Source(5), RunsOutOfMemory(2), CPU))
    with pytest.raises(torch.OutOfMemoryError, match="decoding batch 2"):
        list(prepared(RunsOutOfMemory(2), batch, None, CPU) for batch in Source(5))

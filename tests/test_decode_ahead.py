"""`feed.decoded_ahead`: --decode gpu's thread that decodes ahead of the training thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from imagenet_elastic.data.feed import decoded_ahead
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

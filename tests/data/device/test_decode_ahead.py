"""`feed.decoded_ahead`: --decode gpu's thread that decodes ahead of the training thread; two of them in a chain
(`feed.decoded_in_two_threads`): one decodes the next batch while the other queues the current one's crops; a
batch that runs out of device memory in either (or in the training thread, `feed.prepared`), told to the
training thread and decoded again."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from imagenet_elastic.data.device.feed import decoded_ahead, decoded_in_two_threads, prepared
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


def test_in_two_threads_either_halfs_out_of_memory_reaches_the_taker_in_order_and_that_half_runs_again():
    """The decode (first thread) of batch 2 and the crops (second thread) of batch 4 run out of memory once each:
    the training thread's policy hears of each after the batches before it, with the loader's batch, and each
    half runs again on the same batch: none lost or repeated."""
    told, taken, runs = [], [], {"decoded": [], "finished": []}

    class OutOfMemoryOnce(Halves):
        def run(self, half: str, k: int) -> None:
            runs[half].append(k)
            if (half, k) in (("decoded", 2), ("finished", 4)) and runs[half].count(k) == 1:
                raise torch.OutOfMemoryError(f"CUDA out of memory in {half} of batch {k} (injected)")

    def out_of_memory(batch, line: str, again: bool) -> None:
        told.append((batch if isinstance(batch, int) else batch[0].item(), line, again, list(taken)))

    for staged, _ in decoded_in_two_threads(Source(6), OutOfMemoryOnce(), CPU, out_of_memory):
        taken.append(staged[0])
    assert taken == [0, 1, 2, 3, 4, 5]
    assert told == [(2, "CUDA out of memory in decoded of batch 2 (injected)", False, [0, 1]),
                    (4, "CUDA out of memory in finished of batch 4 (injected)", False, [0, 1, 2, 3])]
    assert runs == {"decoded": [0, 1, 2, 2, 3, 4, 5], "finished": [0, 1, 2, 3, 4, 4, 5]}
    assert decode_threads() == []


def test_in_two_threads_without_a_policy_an_out_of_memory_error_is_raised_as_it_came():
    class OutOfMemory(Halves):
        def run(self, half: str, k: int) -> None:
            if (half, k) == ("decoded", 2):
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        list(decoded_in_two_threads(Source(5), OutOfMemory(), CPU))
    assert decode_threads() == []


def test_in_two_threads_a_policy_that_ends_the_run_ends_both_threads():
    """The training thread's policy raises on the first thread's out-of-memory (the same batch failed again): the
    error reaches the caller and both threads end, the first no longer waiting for an answer."""
    class OutOfMemory(Halves):
        def run(self, half: str, k: int) -> None:
            if (half, k) == ("decoded", 1):
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    def out_of_memory(batch, line: str, again: bool) -> None:
        raise UserError("out of memory again")

    with pytest.raises(UserError, match="^out of memory again$"):
        list(decoded_in_two_threads(Source(100), OutOfMemory(), CPU, out_of_memory))
    assert decode_threads() == []

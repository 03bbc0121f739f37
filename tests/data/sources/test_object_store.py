"""The store's client parts in this process: its settings, the retry policy, ranged reads of a shard's headers, and
the node-local cache of whole shards (one fetch per node for concurrent readers, least recently used eviction under a
cap, nothing cut short left by a killed fetch). The store itself is a function over a local file here; the tests
against a real S3 server are in test_store_training.py."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import tarfile
import time
from pathlib import Path

import pytest
import torch.utils.data

from imagenet_elastic.data.sources import object_store, tar_shards
from imagenet_elastic.data.sources.object_store import Entry, Settings, ShardCache, StoreUnavailable
from imagenet_elastic.errors import UserError


def test_settings_come_from_the_environment_and_a_bad_value_names_its_variable(tmp_path):
    default = object_store.settings({"TMPDIR": str(tmp_path)})
    assert default == Settings(str(tmp_path / "imagenet-elastic-store-cache"), None, 300.0)
    set_ = object_store.settings({"IMAGENET_ELASTIC_STORE_CACHE": "/scratch/c",
                                  "IMAGENET_ELASTIC_STORE_CACHE_GB": "1.5", "IMAGENET_ELASTIC_STORE_TIMEOUT": "20"})
    assert set_ == Settings("/scratch/c", int(1.5 * 2 ** 30), 20.0)
    for name in ("IMAGENET_ELASTIC_STORE_CACHE_GB", "IMAGENET_ELASTIC_STORE_TIMEOUT"):
        with pytest.raises(UserError, match=f"^{name}='-3' is not a positive number$"):
            object_store.settings({name: "-3"})


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
@pytest.mark.parametrize("name", ["IMAGENET_ELASTIC_STORE_CACHE_GB", "IMAGENET_ELASTIC_STORE_TIMEOUT"])
def test_a_setting_that_is_not_a_finite_number_is_refused_naming_its_variable(name, value):
    with pytest.raises(UserError) as raised:
        object_store.settings({name: value})
    assert f"{name}={value!r}" in str(raised.value)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def failing(times: int, error: BaseException, then: object = b"ok"):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return then

    return call, calls


def test_transient_failures_are_retried_with_growing_jittered_waits_and_the_call_answers():
    clock = FakeClock()
    call, calls = failing(4, ConnectionResetError("reset by peer"))
    assert object_store.patiently("s3://b/k", call, timeout=60, sleep=clock.sleep, clock=clock) == b"ok"
    assert len(calls) == 5 and len(clock.slept) == 4
    assert all(0 <= wait <= min(20, 0.5 * 2 ** k) for k, wait in enumerate(clock.slept))


def test_a_fault_of_ours_is_raised_at_once_not_retried_as_the_stores():
    clock = FakeClock()
    call, calls = failing(1, TypeError("unsupported operand"))
    with pytest.raises(TypeError):
        object_store.patiently("s3://b/k", call, timeout=60, sleep=clock.sleep, clock=clock)
    assert len(calls) == 1 and clock.slept == []


def test_a_store_that_stays_away_ends_with_one_line_naming_the_object_at_the_bound():
    clock = FakeClock()
    call, calls = failing(10 ** 6, TimeoutError("read timed out"))
    with pytest.raises(StoreUnavailable) as raised:
        object_store.patiently("s3://b/train/shard-000003.tar", call, timeout=45, sleep=clock.sleep, clock=clock)
    assert "s3://b/train/shard-000003.tar" in str(raised.value) and "45 s" in str(raised.value)
    assert "\n" not in str(raised.value) and raised.value.exit_code == 69 and raised.value.every_rank
    assert 45 <= clock.now <= 45 + 1e-9 and len(calls) > 3  # it retried until the bound, and not past it


def test_a_wait_for_the_store_is_said_once_at_its_first_failure_outside_loader_workers(capsys, monkeypatch):
    clock = FakeClock()
    call, _ = failing(4, ConnectionRefusedError("connect call failed"))
    object_store.patiently("https://host:9/k", call, timeout=60, sleep=clock.sleep, clock=clock)
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and "https://host:9/k" in warnings[0] and "60 s" in warnings[0]
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())  # in a worker: silent
    object_store.patiently("https://host:9/k", failing(4, ConnectionRefusedError("refused"))[0], timeout=60,
                           sleep=clock.sleep, clock=clock)
    assert capsys.readouterr().err == ""


def gcsfs_http_error(code: int, message: str) -> Exception:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": message})


def aiohttp_answer(status: int) -> Exception:
    """What fsspec's HTTP file system raises for an answer it does not take (raise_for_status)."""
    import aiohttp
    from yarl import URL

    return aiohttp.ClientResponseError(aiohttp.RequestInfo(URL("https://host/k"), "GET", {}), (), status=status)


@pytest.mark.parametrize("error, says", [
    (FileNotFoundError("NoSuchKey"), "does not exist"),
    (PermissionError("InvalidAccessKeyId"), "access refused"),  # s3fs's
    (gcsfs_http_error(401, "Invalid Credentials"), "access refused"),  # gcsfs's, which it would retry
    (OSError("Forbidden: b/o/k\nno storage.objects.get access"), "access refused"),  # gcsfs's 403
    (aiohttp_answer(403), "access refused")])  # https://'s
@pytest.mark.filterwarnings("error::DeprecationWarning")  # aiohttp's `code`, which its next major removes
def test_a_missing_object_or_refused_credentials_are_the_users_at_once(error, says):
    clock = FakeClock()
    call, calls = failing(1, error)
    with pytest.raises(UserError, match=f"^s3://b/k.*{says}") as raised:
        object_store.patiently("s3://b/k", call, timeout=60, sleep=clock.sleep, clock=clock)
    assert len(calls) == 1 and clock.slept == [] and not isinstance(raised.value, StoreUnavailable)


def https_not_found(cause: BaseException) -> FileNotFoundError:
    """What fsspec's https:// file system raises for any failure to describe an object: FileNotFoundError from it."""
    try:
        raise FileNotFoundError("https://host/k") from cause
    except FileNotFoundError as error:
        return error


@pytest.mark.parametrize("cause", [ConnectionRefusedError(111, "Connect call failed"), aiohttp_answer(503)],
                         ids=["connection refused", "503"])
def test_an_https_store_out_of_reach_is_retried_then_said_to_be_not_called_a_missing_object(cause):
    clock = FakeClock()
    call, calls = failing(10 ** 6, https_not_found(cause))
    with pytest.raises(StoreUnavailable):
        object_store.patiently("https://host/k", call, timeout=45, sleep=clock.sleep, clock=clock)
    assert len(calls) > 1


def test_an_https_404_is_a_missing_object_at_once():
    clock = FakeClock()
    call, calls = failing(1, https_not_found(aiohttp_answer(404)))
    with pytest.raises(UserError, match="does not exist") as raised:
        object_store.patiently("https://host/k", call, timeout=45, sleep=clock.sleep, clock=clock)
    assert len(calls) == 1 and not isinstance(raised.value, StoreUnavailable)


def botocore_answer(code: str, status: int = 404) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


@pytest.mark.parametrize("cause", [botocore_answer("NoSuchKey"), botocore_answer("NoSuchBucket"),
                                   botocore_answer("404")], ids=["NoSuchKey", "NoSuchBucket", "404"])
def test_an_s3_object_or_bucket_missing_is_said_at_once_not_retried_as_the_store_away(cause):
    """s3fs raises a missing object's FileNotFoundError from botocore's ClientError, a class retried otherwise."""
    clock = FakeClock()
    call, calls = failing(10 ** 6, https_not_found(cause))
    with pytest.raises(UserError, match="does not exist") as raised:
        object_store.patiently("s3://b/k", call, timeout=45, sleep=clock.sleep, clock=clock)
    assert len(calls) == 1 and not isinstance(raised.value, StoreUnavailable)


def test_an_s3_server_error_behind_a_file_not_found_is_still_retried():
    clock = FakeClock()
    call, calls = failing(10 ** 6, https_not_found(botocore_answer("InternalError", 500)))
    with pytest.raises(StoreUnavailable):
        object_store.patiently("s3://b/k", call, timeout=45, sleep=clock.sleep, clock=clock)
    assert len(calls) > 1


@pytest.mark.parametrize("ask", [object_store.find, object_store.info], ids=["find", "info"])
def test_an_https_url_where_nothing_listens_ends_naming_its_host_and_port_not_as_missing(ask):
    with socket.socket() as taken:  # a port free a moment ago: nothing listens there
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
    with pytest.raises(StoreUnavailable) as raised:
        ask(f"http://127.0.0.1:{port}/pack/{tar_shards.INDEX_NAME}", timeout=1)
    assert f"127.0.0.1:{port}" in str(raised.value)


@pytest.fixture
def local_store(tmp_path, monkeypatch):
    """object_store.read_range over local files (`s3://bucket/NAME` is tmp_path/NAME), counting each range read."""
    reads = tmp_path / "reads.log"

    def read_range(url, start, end, timeout):
        with open(reads, "a") as log:
            log.write(f"{os.getpid()} {url} {start} {end}\n")
        with open(tmp_path / url.split("/", 3)[3], "rb") as f:
            f.seek(start)
            return f.read(end - start)

    monkeypatch.setattr(object_store, "read_range", read_range)
    return tmp_path, reads


def shard_entry(folder, name: str, size: int) -> Entry:
    (folder / name).write_bytes(os.urandom(size))
    return Entry(f"s3://bucket/{name}", size, f"etag-{name}")


def test_a_shard_is_fetched_in_chunks_once_and_read_from_the_cache_after(local_store, monkeypatch):
    folder, reads = local_store
    monkeypatch.setattr(object_store, "CHUNK", 1000)
    entry = shard_entry(folder, "a.tar", 2500)
    cache = ShardCache(Settings(str(folder / "cache"), None, 10))
    path = cache.local_copy(entry)
    assert Path(path).read_bytes() == (folder / "a.tar").read_bytes()
    assert [line.split()[2:] for line in reads.read_text().splitlines()] == [["0", "1000"], ["1000", "2000"],
                                                                            ["2000", "2500"]]
    assert cache.local_copy(entry) == path and len(reads.read_text().splitlines()) == 3
    changed = Entry(entry.url, entry.size, "another-etag")  # a new version of the object is another file
    assert cache.local_copy(changed) != path


def _read_in_child(cache_folder: str, entry: Entry, start: multiprocessing.synchronize.Event) -> None:
    start.wait()
    ShardCache(Settings(cache_folder, None, 10)).local_copy(entry)


def test_the_nodes_processes_asking_at_once_fetch_a_shard_once(local_store, monkeypatch):
    folder, reads = local_store
    entry = shard_entry(folder, "b.tar", 300_000)
    context = multiprocessing.get_context("fork")
    go = context.Event()
    children = [context.Process(target=_read_in_child, args=(str(folder / "cache"), entry, go)) for _ in range(4)]
    for child in children:
        child.start()
    go.set()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0] * 4
    assert len(reads.read_text().splitlines()) == 1  # one process fetched, the others waited on its lock


def test_the_least_recently_used_shards_go_first_when_the_cap_is_reached(local_store):
    folder, reads = local_store
    cache = ShardCache(Settings(str(folder / "cache"), 2500, 10))
    a, b, c = (shard_entry(folder, f"{n}.tar", 1000) for n in "abc")
    pa, pb = cache.local_copy(a), cache.local_copy(b)
    os.utime(pb, (time.time() - 100, time.time() - 100))  # b used long ago, a just now
    pc = cache.local_copy(c)
    assert os.path.exists(pa) and os.path.exists(pc) and not os.path.exists(pb)
    with pytest.raises(UserError, match=r"a shard of 0\.00286\d* MiB exceeds IMAGENET_ELASTIC_STORE_CACHE_GB"):
        cache.local_copy(shard_entry(folder, "big.tar", 3000))  # its size said, not 0.0


def _fetch_forever(cache_folder: str, entry: Entry, stalled: str) -> None:
    def stall(url, start, end, timeout):
        if start > 0:
            open(stalled, "w").close()
            time.sleep(60)
        return b"\0" * (end - start)

    object_store.read_range = stall
    object_store.CHUNK = 100
    ShardCache(Settings(cache_folder, None, 10)).local_copy(entry)


def test_a_fetch_killed_midway_leaves_no_shard_and_its_part_file_goes_at_the_next_eviction(local_store):
    folder, _ = local_store
    entry = shard_entry(folder, "k.tar", 1000)
    cache = ShardCache(Settings(str(folder / "cache"), 10_000, 10))
    stalled = folder / "stalled"
    child = multiprocessing.get_context("fork").Process(target=_fetch_forever,
                                                        args=(str(folder / "cache"), entry, str(stalled)))
    child.start()
    part = f"{cache.path(entry)}.part-{child.pid}"
    deadline = time.time() + 20
    while not stalled.exists() and time.time() < deadline:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert os.path.exists(part) and not os.path.exists(cache.path(entry))
    assert Path(cache.local_copy(entry)).read_bytes() == (folder / "k.tar").read_bytes()  # fetched whole, anew
    assert not os.path.exists(part)


def test_a_shards_headers_are_walked_by_ranged_reads_to_the_index_a_local_walk_gives(local_store, image_folder):
    folder, reads = local_store
    shard = folder / "w.tar"
    with tarfile.open(shard, "w") as tar:
        for k, image in enumerate(sorted((image_folder / "train").rglob("*.jpg"))[:6]):
            tar.add(image, f"s{k:03d}.jpg")
            label = folder / "label"
            label.write_text(str(k % 4))
            tar.add(label, f"s{k:03d}.cls")
    entry = Entry("s3://bucket/w.tar", shard.stat().st_size, "e")
    remote = tar_shards.walk_shard(entry.url, "train", entry=entry)
    local = tar_shards.walk_shard(str(shard), "train")
    assert remote == local and remote.labels == [0, 1, 2, 3, 0, 1]
    assert len(reads.read_text().splitlines()) < 6 * 2  # a header and its label share a read


def disk_of(monkeypatch, total: int, free: int) -> None:
    """The cache's file system as this test says, not as the host's disk happens to be."""
    usage = shutil._ntuple_diskusage(total, total - free, free)
    monkeypatch.setattr(object_store.shutil, "disk_usage", lambda _: usage)


def test_a_cache_smaller_than_the_split_is_said_at_start_and_one_that_holds_it_is_not(tmp_path, monkeypatch):
    capped = Settings(str(tmp_path / "cache"), 2 ** 30, 10)
    note = object_store.short_cache_note(capped, 3 * 2 ** 30, "s3://b/pack/train")
    assert note is not None and "room for 1.0 GiB, less than s3://b/pack/train (3.0 GiB)" in note
    assert object_store.short_cache_note(capped, 2 ** 30, "s3://b/pack/train") is None
    disk_of(monkeypatch, total=100 * 2 ** 30, free=30 * 2 ** 30)
    free = Settings(str(tmp_path / "cache"), None, 10)  # no cap: the file system's room, less 10% of it
    assert object_store.short_cache_note(free, 20 * 2 ** 30, "s3://b/pack/train") is None
    note = object_store.short_cache_note(free, 21 * 2 ** 30, "s3://b/pack/train")
    assert note is not None and "room for 20.0 GiB" in note


def test_with_no_cap_shards_go_to_keep_a_tenth_of_the_file_system_free(local_store, monkeypatch):
    folder, _ = local_store
    cache = ShardCache(Settings(str(folder / "cache"), None, 10))
    a, b, c = (shard_entry(folder, f"{n}.tar", 1000) for n in "abc")
    disk_of(monkeypatch, total=100_000, free=12_500)  # room for two shards above the tenth kept free
    pa, pb = cache.local_copy(a), cache.local_copy(b)
    os.utime(pa, (time.time() - 100, time.time() - 100))
    disk_of(monkeypatch, total=100_000, free=10_500)  # a and b took their room: c's needs one of them gone
    pc = cache.local_copy(c)
    assert not os.path.exists(pa) and os.path.exists(pb) and os.path.exists(pc)


def test_a_gcs_emulator_is_read_through_gcsfss_json_api_anonymously(monkeypatch):
    """Not gcsfs's default class, whose bucket-layout probe speaks gRPC, which emulators do not."""
    from gcsfs.core import GCSFileSystem

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    made = object_store.filesystem("gs://bucket/key", timeout=30)
    assert type(made) is GCSFileSystem and made.credentials.token == "anon" and made.timeout == 10

"""The object-store harness itself (scripts/store_servers.py): what the tests of s3:// and https:// training rely on."""

from __future__ import annotations

import hashlib
import http.client
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import store_servers
from conftest import REPO, child_env

pytestmark = pytest.mark.slow  # each starts server processes

botocore_exceptions = pytest.importorskip("botocore.exceptions")
NO_RETRIES = {"retries": {"total_max_attempts": 1}}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Two small binary shards in a nested folder, and an empty file."""
    root = tmp_path_factory.mktemp("shards")
    (root / "train").mkdir()
    (root / "train" / "shard-000.tar").write_bytes(os.urandom(300_000))
    (root / "train" / "shard-001.tar").write_bytes(bytes(range(256)) * 40)
    (root / "empty.txt").write_bytes(b"")
    return root


def listing(client, bucket: str) -> dict[str, tuple[int, str]]:
    return {o["Key"]: (o["Size"], o["ETag"]) for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def md5_etag(path: Path) -> str:
    return f'"{hashlib.md5(path.read_bytes()).hexdigest()}"'


def test_put_folder_uploads_every_file_under_the_prefix(s3_server, shards):
    keys = s3_server.put_folder(shards, "put-folder", "imagenet/v1")
    assert keys == ["imagenet/v1/empty.txt", "imagenet/v1/train/shard-000.tar", "imagenet/v1/train/shard-001.tar"]
    client = s3_server.client()
    found = listing(client, "put-folder")
    for key in keys:
        path = shards / key.removeprefix("imagenet/v1/")
        assert found[key] == (path.stat().st_size, md5_etag(path))
    body = client.get_object(Bucket="put-folder", Key="imagenet/v1/train/shard-001.tar")["Body"].read()
    assert body == (shards / "train" / "shard-001.tar").read_bytes()


def test_restart_loses_everything_and_restore_puts_back_the_same_objects(fresh_s3_server, shards):
    server = fresh_s3_server
    server.put_folder(shards, "restart", "p")
    server.put_bytes(b"label\n", "other", "labels.txt")
    before = {bucket: listing(server.client(), bucket) for bucket in ("restart", "other")}
    port = server.port

    server.restart(restore=False)
    assert server.port == port
    with pytest.raises(botocore_exceptions.ClientError, match="NoSuchBucket"):
        server.client().list_objects_v2(Bucket="restart")  # moto keeps nothing across a restart

    server.restore()
    assert {bucket: listing(server.client(), bucket) for bucket in ("restart", "other")} == before

    server.kill()
    assert not server.running
    server.start()
    server.restore()
    assert {bucket: listing(server.client(), bucket) for bucket in ("restart", "other")} == before


def get(port: int, path: str, method: str = "GET", connection=None, **headers):
    connection = connection or http.client.HTTPConnection(store_servers.HOST, port, timeout=10)
    connection.request(method, path, headers=headers)
    response = connection.getresponse()
    return response, response.read()


def test_range_http_server_answers_ranges_head_and_missing_files(range_http_server, shards):
    server = range_http_server(shards)
    data = (shards / "train" / "shard-000.tar").read_bytes()
    path = "/train/shard-000.tar"
    connection = http.client.HTTPConnection(store_servers.HOST, server.port, timeout=10)  # keep-alive throughout

    response, body = get(server.port, path, connection=connection)
    assert (response.status, body, response.getheader("Accept-Ranges")) == (200, data, "bytes")
    etag = response.getheader("ETag")

    for wanted, first, last in (("bytes=100-199", 100, 199), ("bytes=299990-", 299990, 299999),
                                ("bytes=-7", 299993, 299999), ("bytes=299000-999999", 299000, 299999)):
        response, body = get(server.port, path, connection=connection, Range=wanted)
        assert response.status == 206, wanted
        assert body == data[first:last + 1]
        assert response.getheader("Content-Range") == f"bytes {first}-{last}/300000"
        assert int(response.getheader("Content-Length")) == last - first + 1
        assert response.getheader("ETag") == etag

    for bad in ("bytes=300000-", "bytes=5-2", "bytes=-0", "bytes=x-y"):
        response, _ = get(server.port, path, connection=connection, Range=bad)
        assert (response.status, response.getheader("Content-Range")) == (416, "bytes */300000"), bad
    response, body = get(server.port, path, connection=connection, Range="bytes=0-1,5-6")
    assert (response.status, len(body)) == (200, 300000)  # several ranges: the whole file

    response, body = get(server.port, path, "HEAD", connection=connection)
    assert (response.status, body) == (200, b"")
    assert (response.getheader("Content-Length"), response.getheader("ETag")) == ("300000", etag)
    assert response.getheader("Last-Modified").endswith("GMT")

    (shards.parent / "outside.txt").write_bytes(b"not served")
    for missing in ("/train/nothing.tar", "/train/", "/../outside.txt", "/%2e%2e/outside.txt"):
        assert get(server.port, missing, connection=connection)[0].status == 404, missing
    assert get(server.port, "/empty.txt", connection=connection)[1] == b""

    server.stop()
    server.start()  # the same port again
    assert get(server.port, path, Range="bytes=0-3")[1] == data[:4]


def test_proxy_503_mode_gives_s3_slow_down(s3_server, fault_proxy, shards):
    s3_server.put_folder(shards, "slow-down")
    proxy = fault_proxy(s3_server)
    client = store_servers.s3_client(proxy.endpoint, **NO_RETRIES)
    proxy.set_mode("503")
    with pytest.raises(botocore_exceptions.ClientError) as error:
        client.get_object(Bucket="slow-down", Key="empty.txt")
    assert error.value.response["Error"]["Code"] == "SlowDown"
    assert error.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    with pytest.raises(botocore_exceptions.ClientError, match="503"):
        client.head_object(Bucket="slow-down", Key="empty.txt")
    proxy.set_mode("pass")
    assert client.head_object(Bucket="slow-down", Key="empty.txt")["ContentLength"] == 0
    assert proxy.stats()["faults"] == 2


def test_proxy_reset_mode_gives_a_connection_error(s3_server, fault_proxy, shards):
    s3_server.put_folder(shards, "reset")
    proxy = fault_proxy(s3_server)
    client = store_servers.s3_client(proxy.endpoint, **NO_RETRIES)
    proxy.set_mode("reset")
    with pytest.raises((botocore_exceptions.ConnectionClosedError, botocore_exceptions.EndpointConnectionError)):
        client.get_object(Bucket="reset", Key="empty.txt")
    assert proxy.stats()["faults"] == 1


def test_proxy_stall_mode_gives_a_read_timeout(s3_server, fault_proxy, shards):
    s3_server.put_folder(shards, "stall")
    proxy = fault_proxy(s3_server)
    client = store_servers.s3_client(proxy.endpoint, read_timeout=0.5, **NO_RETRIES)
    proxy.set_mode("stall")
    started = time.monotonic()
    with pytest.raises(botocore_exceptions.ReadTimeoutError):
        client.get_object(Bucket="stall", Key="empty.txt")
    assert time.monotonic() - started < 5
    proxy.set_mode("pass")  # new requests pass, the stalled one stays stalled
    assert client.get_object(Bucket="stall", Key="empty.txt")["Body"].read() == b""


def test_fail_next_fails_exactly_that_many_requests_on_a_kept_connection(s3_server, fault_proxy, shards):
    s3_server.put_folder(shards, "fail-next")
    proxy = fault_proxy(s3_server)
    client = store_servers.s3_client(proxy.endpoint, **NO_RETRIES)
    client.head_object(Bucket="fail-next", Key="empty.txt")  # opens the kept connection
    proxy.fail_next(2, "503")
    for _ in range(2):
        with pytest.raises(botocore_exceptions.ClientError, match="SlowDown"):
            client.get_object(Bucket="fail-next", Key="empty.txt")
    assert client.get_object(Bucket="fail-next", Key="empty.txt")["Body"].read() == b""
    assert (proxy.stats()["requests"], proxy.stats()["faults"]) == (4, 2)

    retrying = store_servers.s3_client(proxy.endpoint, retries={"mode": "standard", "total_max_attempts": 3})
    proxy.reset_stats()
    proxy.fail_next(2, "reset")
    assert retrying.get_object(Bucket="fail-next", Key="empty.txt")["Body"].read() == b""
    assert [r["fault"] for r in proxy.requests()] == ["reset", "reset", None]


def test_stats_count_requests_and_body_bytes(s3_server, fault_proxy, shards):
    s3_server.put_folder(shards, "stats")
    proxy = fault_proxy(s3_server)
    client = store_servers.s3_client(proxy.endpoint, **NO_RETRIES)
    key = "train/shard-000.tar"
    assert len(client.get_object(Bucket="stats", Key=key)["Body"].read()) == 300_000
    assert len(client.get_object(Bucket="stats", Key=key, Range="bytes=1000-1099")["Body"].read()) == 100
    client.head_object(Bucket="stats", Key=key)
    stats = proxy.stats()
    assert (stats["requests"], stats["bytes"], stats["faults"], stats["upstream_errors"]) == (3, 300_100, 0, 0)
    assert [(r["method"], r["path"], r["range"], r["status"], r["bytes"]) for r in proxy.requests()] == [
        ("GET", f"/stats/{key}", None, 200, 300_000), ("GET", f"/stats/{key}", "bytes=1000-1099", 206, 100),
        ("HEAD", f"/stats/{key}", None, 200, 0)]
    proxy.reset_stats()
    assert (proxy.stats()["requests"], proxy.stats()["bytes"], proxy.requests()) == (0, 0, [])
    with pytest.raises(ValueError, match="not one of"):
        proxy.set_mode("teapot")


def test_proxy_counts_each_request_of_a_kept_connection_and_cuts_bodies(range_http_server, fault_proxy, shards):
    proxy = fault_proxy(range_http_server(shards))
    data = (shards / "train" / "shard-000.tar").read_bytes()
    connection = http.client.HTTPConnection(store_servers.HOST, proxy.port, timeout=10)
    for first in (0, 10, 20):
        response, body = get(proxy.port, "/train/shard-000.tar", connection=connection, Range=f"bytes={first}-")
        assert (response.status, body) == (206, data[first:])
    assert (proxy.stats()["requests"], proxy.stats()["connections"]) == (3, 1)

    proxy.set_mode("cut", cut_after=5000)
    with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
        get(proxy.port, "/train/shard-000.tar")
    assert proxy.requests()[-1] == {"method": "GET", "path": "/train/shard-000.tar", "range": None, "status": 200,
                                    "bytes": 5000, "fault": "cut"}

    proxy.set_mode("pass", delay=0.3)
    started = time.monotonic()
    assert get(proxy.port, "/empty.txt")[0].status == 200
    assert time.monotonic() - started >= 0.3


def test_a_stopped_server_behind_the_proxy_is_a_connection_error_until_restarted(fresh_s3_server, fault_proxy,
                                                                                  shards):
    fresh_s3_server.put_folder(shards, "outage")
    proxy = fault_proxy(fresh_s3_server)
    client = store_servers.s3_client(proxy.endpoint, **NO_RETRIES)
    fresh_s3_server.stop()
    with pytest.raises((botocore_exceptions.ConnectionClosedError, botocore_exceptions.EndpointConnectionError)):
        client.get_object(Bucket="outage", Key="empty.txt")
    assert proxy.stats()["upstream_errors"] == 1
    fresh_s3_server.start()
    fresh_s3_server.restore()
    assert client.get_object(Bucket="outage", Key="train/shard-001.tar")["ContentLength"] == 10240


def test_s3fs_reads_through_the_proxy(s3_server, fault_proxy, shards):
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    s3_server.put_folder(shards, "s3fs")
    proxy = fault_proxy(s3_server)
    fs = fsspec.filesystem("s3", key="testing", secret="testing", skip_instance_cache=True,
                           client_kwargs={"endpoint_url": proxy.endpoint, "region_name": "us-east-1"})
    data = (shards / "train" / "shard-000.tar").read_bytes()
    assert fs.cat_file("s3fs/train/shard-000.tar", start=1000, end=1100) == data[1000:1100]
    assert sorted(fs.ls("s3fs/train")) == ["s3fs/train/shard-000.tar", "s3fs/train/shard-001.tar"]
    assert ("GET", "bytes=1000-1099") in [(r["method"], r["range"]) for r in proxy.requests()]

    proxy.fail_next(1, "503")  # s3fs retries a SlowDown itself
    assert fs.cat_file("s3fs/train/shard-001.tar") == (shards / "train" / "shard-001.tar").read_bytes()
    assert proxy.requests()[-2]["fault"] == "503"


def test_env_lets_a_client_process_reach_s3_through_the_proxy(s3_server, fault_proxy, shards):
    """What a test of `python -m imagenet_elastic s3://...` does: the server's address only in the environment."""
    pytest.importorskip("s3fs")
    s3_server.put_folder(shards, "env")
    proxy = fault_proxy(s3_server)
    read = textwrap.dedent("""
        import boto3, fsspec
        with fsspec.open("s3://env/train/shard-001.tar", "rb") as f:
            print(len(f.read()))
        print(boto3.client("s3").head_object(Bucket="env", Key="empty.txt")["ContentLength"])
    """)
    result = subprocess.run([sys.executable, "-c", read], cwd=REPO, env={**child_env(), **proxy.env()},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["10240", "0"]
    assert proxy.stats()["requests"] >= 2


def test_fsspec_http_reads_a_byte_range(range_http_server, fault_proxy, shards):
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    proxy = fault_proxy(range_http_server(shards))
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    url = f"{proxy.url}/train/shard-000.tar"
    data = (shards / "train" / "shard-000.tar").read_bytes()
    assert fs.size(url) == 300_000
    assert fs.cat_file(url, start=4096, end=4196) == data[4096:4196]
    with fs.open(url, "rb", block_size=1024) as f:
        f.seek(299_000)
        assert f.read(10) == data[299_000:299_010]
    ranged = [r for r in proxy.requests() if r["method"] == "GET"]
    assert ranged and all(r["status"] == 206 and r["bytes"] <= 2048 for r in ranged)


def test_a_failed_start_says_why_and_leaves_nothing_running(tmp_path, range_http_server, shards):
    taken = range_http_server(shards)
    server = store_servers.RangeHTTPServer(shards, port=taken.port, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="Address already in use"):
        server.start()
    assert server.proc is None and server not in store_servers._LIVE


@pytest.mark.parametrize("ending", ["exit", "SIGKILL"])
def test_servers_end_with_the_process_that_started_them(tmp_path, shards, ending):
    """atexit stops them at a normal exit, the kernel (PR_SET_PDEATHSIG) when the starter is killed."""
    starter = textwrap.dedent(f"""
        import os, signal, store_servers
        server = store_servers.RangeHTTPServer({str(shards)!r}, log_dir={str(tmp_path)!r}).start()
        print(server.proc.pid, flush=True)
        if {ending!r} == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", starter], cwd=REPO / "scripts", env=child_env(),
                            capture_output=True, text=True, timeout=60)
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, f"server {pid} outlived its starter"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False

"""Object stores on 127.0.0.1 for the tests of training from s3://, gs:// and https:// shards: moto's S3 server, a
GCS emulator, an HTTP server with Range support, and a proxy that injects faults in front of them. Each runs in a
process of its own, so a client's connection pool, retries and time-outs meet real sockets, as they would meet S3 or a
CDN.

A test harness, outside the installed package: tests/conftest.py's fixtures start these; the child side is
`python scripts/store_servers.py {moto PORT | http-serve FOLDER PORT | gcs PORT | proxy HOST:PORT PORT}`. Only the
stdlib is imported here at module level, so the children start in a fraction of a second (boto3 where an upload
needs it).

Every child is stopped by its owner's stop() (fixtures, context managers), by this module's atexit hook, and,
on Linux, by the kernel when the thread that started it dies (PR_SET_PDEATHSIG): a killed pytest leaves no
server behind. Hence: start servers from a thread that outlives them (pytest's main thread does).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import email.utils
import http.client
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union
from urllib.parse import unquote, urlsplit

HOST = "127.0.0.1"
START_TIMEOUT = 20.0  # seconds a server may take to answer; moto imports ~1 s on a 2-core machine
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "us-east-1"
_PARENT_VAR = "OBJECT_STORE_PARENT_PID"
_LIVE: set[_ServerProcess] = set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def s3_env(endpoint: str, max_attempts: Optional[int] = None) -> dict[str, str]:
    """What a client process (boto3, s3fs) needs to reach `endpoint` and nothing else: fake credentials, no
    instance-metadata lookup (a 1-2 s time-out per client off EC2), no ~/.aws files, no HTTP proxy."""
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint, **CREDENTIALS,
           "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, **local_env()}
    if max_attempts is not None:
        env["AWS_MAX_ATTEMPTS"] = str(max_attempts)
    return env


def local_env() -> dict[str, str]:
    """127.0.0.1 never through a proxy a machine's environment may name."""
    return {"NO_PROXY": f"{HOST},localhost", "no_proxy": f"{HOST},localhost"}


def s3_client(endpoint: str, **config):
    """A boto3 S3 client of `endpoint`; `config` goes to botocore's Config (retries, read_timeout, ...)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name=REGION, config=Config(**config),
                        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


class _ServerProcess:
    """A child process serving on 127.0.0.1:`port`, restartable on the same port; its stderr goes to a log
    file (a pipe nobody reads would block a server that logs every request) quoted when it fails to start."""

    name = "server"

    def __init__(self, port: int = 0, log_dir: Optional[Union[str, Path]] = None) -> None:
        self.port = port
        self.proc: Optional[subprocess.Popen] = None
        self._started_once = False
        self._own_log_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-")) if log_dir is None else Path(log_dir)
        self.log_path = self.log_dir / f"{self.name}-{id(self):x}.log"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _wait_ready(self, deadline: float) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self):
        """Start (again, on the same port once it has one). Returns self."""
        if self.running:
            return self
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=log, start_new_session=True,
                                         env={**os.environ, _PARENT_VAR: str(os.getpid()), **local_env()})
        _LIVE.add(self)
        try:
            self._wait_ready(time.monotonic() + START_TIMEOUT)
        except BaseException:
            self.kill()
            raise
        self._started_once = True
        return self

    def _failed(self, why: str) -> RuntimeError:
        log = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
        return RuntimeError(f"{self.name} on port {self.port} {why}; its stderr ({self.log_path}):\n{log}")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        self._end(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request, as a crashed host would."""
        self._end(signal.SIGKILL, 5.0)

    def _end(self, sig: int, timeout: float) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
        if proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        """stop(), and remove the log if this object made its folder."""
        self.stop()
        if self._own_log_dir:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
                self.log_dir.rmdir()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait_ready_line(self, deadline: float) -> list[int]:
        """The ports the child prints on its first line, `READY PORT...`, once it listens."""
        assert self.proc is not None and self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline().decode().split()
                if line[:1] == ["READY"]:
                    return [int(port) for port in line[1:]]
                raise self._failed(f"exited with {self.proc.wait()} before it listened")
        raise self._failed(f"did not listen within {START_TIMEOUT:.0f} s")


class S3Server(_ServerProcess):
    """moto's S3 server (`python -m moto.server`) in its own process.

    moto keeps everything in memory and cannot persist it (its recorder replays every logged request, reads and
    multipart uploads included, and is not a snapshot), so a restart starts empty: restore(), or
    restart(restore=True), puts back every bucket and object put through this object, with the same ETags
    (single-part puts: the MD5 of the bytes). Objects a client wrote are not restored."""

    name = "moto"

    def __init__(self, port: int = 0, log_dir: Optional[Union[str, Path]] = None) -> None:
        super().__init__(port or free_port(), log_dir)
        self._buckets: list[str] = []
        self._objects: dict[tuple[str, str], Union[Path, bytes]] = {}  # (bucket, key) -> file or bytes

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self, endpoint: Optional[str] = None, max_attempts: Optional[int] = None) -> dict[str, str]:
        """Environment variables for a client process; `endpoint` to go through a FaultProxy instead."""
        return s3_env(endpoint or self.endpoint, max_attempts)

    def client(self, **config):
        return s3_client(self.endpoint, **config)

    def start(self) -> S3Server:
        """moto takes its port on the command line: a port picked free may be taken before moto binds it, so
        the first start tries another (a restart keeps its port)."""
        for attempt in range(3):
            try:
                return super().start()
            except RuntimeError as e:
                if self._started_once or attempt == 2 or "Address already in use" not in str(e):
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _command(self) -> list[str]:
        return [sys.executable, __file__, "moto", str(self.port)]

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise self._failed(f"exited with {self.proc.returncode if self.proc else None}")
            try:
                connection = http.client.HTTPConnection(HOST, self.port, timeout=2)
                connection.request("GET", "/moto-api/")
                connection.getresponse().read()
                connection.close()
                return
            except OSError:
                time.sleep(0.05)
        raise self._failed(f"did not answer within {START_TIMEOUT:.0f} s")

    def restart(self, restore: bool = True) -> S3Server:
        """stop() and start() on the same port; the objects put through here back with `restore`."""
        self.stop()
        self.start()
        if restore:
            self.restore()
        return self

    def create_bucket(self, bucket: str) -> None:
        client = self.client()
        if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=bucket)
        if bucket not in self._buckets:
            self._buckets.append(bucket)

    def put_file(self, path: Union[str, Path], bucket: str, key: str) -> str:
        """Upload one file (one PutObject, so the ETag is its MD5); returns the ETag."""
        self.create_bucket(bucket)
        self._objects[(bucket, key)] = Path(path)
        return self._put(bucket, key, Path(path).read_bytes())

    def put_bytes(self, data: bytes, bucket: str, key: str) -> str:
        self.create_bucket(bucket)
        self._objects[(bucket, key)] = bytes(data)
        return self._put(bucket, key, data)

    def put_folder(self, folder: Union[str, Path], bucket: str, prefix: str = "") -> list[str]:
        """Upload every file under `folder` to s3://bucket/prefix/<relative path>; returns the keys, sorted."""
        folder = Path(folder)
        keys = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = "/".join(part for part in (prefix.strip("/"), path.relative_to(folder).as_posix()) if part)
            self.put_file(path, bucket, key)
            keys.append(key)
        return keys

    def _put(self, bucket: str, key: str, data: bytes) -> str:
        return self.client().put_object(Bucket=bucket, Key=key, Body=data)["ETag"]

    def restore(self) -> None:
        """Put back what put_file/put_bytes/put_folder/create_bucket put (files read again from disk)."""
        for bucket in self._buckets:
            self.create_bucket(bucket)
        for (bucket, key), source in self._objects.items():
            self._put(bucket, key, source.read_bytes() if isinstance(source, Path) else source)

    def reset(self) -> None:
        """Empty the server (moto's /moto-api/reset) and forget what restore() would put back."""
        connection = http.client.HTTPConnection(HOST, self.port, timeout=10)
        connection.request("POST", "/moto-api/reset")
        assert connection.getresponse().status == 200
        connection.close()
        self._buckets.clear()
        self._objects.clear()


class RangeHTTPServer(_ServerProcess):
    """A folder over plain HTTP/1.1 with single-range requests (206, 416), HEAD, ETag and Last-Modified: what
    fsspec's HTTP filesystem needs of a CDN. No listings, no multi-range (answered 200 with the whole file, as
    RFC 9110 allows), no conditional requests."""

    name = "http"

    def __init__(self, folder: Union[str, Path], port: int = 0, log_dir: Optional[Union[str, Path]] = None) -> None:
        super().__init__(port, log_dir)
        self.folder = Path(folder)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    endpoint = url

    def env(self) -> dict[str, str]:
        return local_env()

    def _command(self) -> list[str]:
        return [sys.executable, __file__, "http-serve", str(self.folder), str(self.port)]

    def _wait_ready(self, deadline: float) -> None:
        (self.port,) = self._wait_ready_line(deadline)


class GcsServer(_ServerProcess):
    """A Google Cloud Storage emulator (gcp-storage-emulator's handlers, in memory, one thread per connection) in its
    own process: GCS's JSON API, which gcsfs speaks, at STORAGE_EMULATOR_HOST. A restart starts empty."""

    name = "gcs"

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint, **local_env()}

    def _command(self) -> list[str]:
        return [sys.executable, __file__, "gcs", str(self.port)]

    def _wait_ready(self, deadline: float) -> None:
        (self.port,) = self._wait_ready_line(deadline)

    def create_bucket(self, bucket: str) -> None:
        """A bucket (GCS's JSON API, as a client creates one); one that exists is kept. Objects go in through the
        client under test (`pack ... gs://`)."""
        connection = http.client.HTTPConnection(HOST, self.port, timeout=30)
        try:
            connection.request("POST", "/storage/v1/b?project=test", body=json.dumps({"name": bucket}).encode(),
                               headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            text = answer.read()
        finally:
            connection.close()
        if answer.status >= 300 and answer.status != 409:  # 409: it exists
            raise RuntimeError(f"creating bucket {bucket}: {answer.status} {text[:200]!r}")


MODES = ("pass", "reset", "stall", "503", "cut")


class FaultProxy(_ServerProcess):
    """An HTTP/1.1 proxy in front of an S3Server or RangeHTTPServer that fails requests on demand.

    Modes (set_mode: every request from now on; fail_next: the next n requests, then the mode set before):
      pass   forward
      reset  read the request's head, then close the connection with a TCP RST (a connection error)
      stall  read the request's head, then never answer (a read time-out); the connection stays stalled even
             once the mode changes
      503    answer `503 Slow Down` with S3's XML error body (<Code>SlowDown</Code>), then close
      cut    forward the response's head and `cut_after` bytes of its body, then RST (a short read mid-body)
    `delay` seconds are added before each forwarded request (a slow store).

    Counting is per HTTP request, exactly: the proxy parses each request on a client's keep-alive connection
    (Content-Length or chunked bodies; `Expect: 100-continue` answered by the proxy) and takes the mode at the
    moment the request's head arrives, so fail_next(2) fails exactly the next two requests whatever connections
    they come on. The client's keep-alive is kept; upstream, every request goes on a fresh connection with
    `Connection: close` (a restarted or killed server never leaves a stale connection in the proxy). An upstream
    that refuses the connection (stopped) gives the client a reset. stats()["bytes"] counts the response body
    bytes sent to clients (chunked framing included; moto and RangeHTTPServer send Content-Length)."""

    name = "proxy"

    def __init__(self, upstream: Union[_ServerProcess, str], port: int = 0,
                 log_dir: Optional[Union[str, Path]] = None) -> None:
        super().__init__(port, log_dir)
        self.upstream = upstream
        self.control_port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    url = endpoint

    def env(self, max_attempts: Optional[int] = None) -> dict[str, str]:
        """The upstream's client environment, pointed at this proxy."""
        if isinstance(self.upstream, S3Server):
            return self.upstream.env(self.endpoint, max_attempts)
        return local_env()

    def _upstream_address(self) -> str:
        if isinstance(self.upstream, _ServerProcess):
            return f"{HOST}:{self.upstream.port}"
        parts = urlsplit(self.upstream if "//" in self.upstream else f"//{self.upstream}")
        return f"{parts.hostname}:{parts.port or 80}"

    def _command(self) -> list[str]:
        return [sys.executable, __file__, "proxy", self._upstream_address(), str(self.port)]

    def _wait_ready(self, deadline: float) -> None:
        self.port, self.control_port = self._wait_ready_line(deadline)

    def _control(self, **message) -> dict:
        with socket.create_connection((HOST, self.control_port), timeout=10) as s:
            s.sendall(json.dumps(message).encode() + b"\n")
            answer = json.loads(s.makefile("rb").readline())
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer

    def set_mode(self, mode: str, cut_after: int = 1024, delay: float = 0.0) -> None:
        self._control(op="mode", mode=mode, cut_after=cut_after, delay=delay)

    def fail_next(self, n: int, mode: str = "503") -> None:
        """The next `n` requests get `mode`, then the mode set before takes over again."""
        self._control(op="fail_next", n=n, mode=mode)

    def stats(self) -> dict[str, int]:
        """{"requests": HTTP requests seen (failed ones included), "bytes": response body bytes sent to clients,
        "faults": requests failed on purpose, "connections": client connections accepted,
        "upstream_errors": requests the upstream refused or dropped}."""
        return self._control(op="stats")["stats"]

    def requests(self) -> list[dict]:
        """Each request, oldest first (the latest 100000): method, path, range, fault, status, bytes."""
        return self._control(op="log")["log"]

    def reset_stats(self) -> None:
        self._control(op="reset_stats")


# ---- the children ------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its starter dies; exit if that already happened."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.environ.get(_PARENT_VAR)
    if parent and os.getppid() != int(parent):
        os._exit(1)


def _ready(*ports: int) -> None:
    print("READY", *ports, flush=True)


def _serve_moto(port: str) -> None:
    from moto.server import main

    main(["-H", HOST, "-p", port])


def _serve_folder(folder: str, port: str) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    root = Path(folder).resolve()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as CDNs do

        def do_HEAD(self) -> None:
            self._serve(with_body=False)

        def do_GET(self) -> None:
            self._serve(with_body=True)

        def _serve(self, with_body: bool) -> None:
            path = (root / unquote(urlsplit(self.path).path).lstrip("/")).resolve()
            if not path.is_relative_to(root) or not path.is_file():
                return self._empty(404, with_body)
            stat = path.stat()
            size = stat.st_size
            first, last, status = 0, size - 1, 200
            if (header := self.headers.get("Range")) is not None:
                wanted = _byte_range(header, size)
                if wanted is None:
                    return self._empty(416, with_body, {"Content-Range": f"bytes */{size}"})
                if wanted != "whole":
                    (first, last), status = wanted, 206
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(last - first + 1))
            self.send_header("ETag", f'"{stat.st_mtime_ns:x}-{size:x}"')
            self.send_header("Last-Modified", email.utils.formatdate(stat.st_mtime, usegmt=True))
            if status == 206:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.end_headers()
            if with_body:
                with open(path, "rb") as f:
                    f.seek(first)
                    left = last - first + 1
                    while left > 0 and (piece := f.read(min(left, 1 << 20))):
                        self.wfile.write(piece)
                        left -= len(piece)

        def _empty(self, status: int, with_body: bool, headers: Optional[dict] = None) -> None:
            body = f"{status}\n".encode()
            self.send_response(status)
            for name, value in {"Accept-Ranges": "bytes", **(headers or {})}.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((HOST, int(port)), Handler)
    _ready(server.server_address[1])
    server.serve_forever()


def _serve_gcs(port: str) -> None:
    from functools import partial
    from http.server import ThreadingHTTPServer

    from gcp_storage_emulator.server import RequestHandler
    from gcp_storage_emulator.storage import Storage

    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((HOST, int(port)), partial(RequestHandler, Storage(use_memory_fs=True)))
    _ready(server.server_address[1])
    server.serve_forever()


def _byte_range(header: str, size: int):
    """(first, last) of a single `bytes=` range, "whole" where RFC 9110 lets a server ignore the header (another
    unit, several ranges), None where it cannot be satisfied or does not parse (answered 416)."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes":
        return "whole"
    if "," in spec:
        return "whole"
    first, dash, last = spec.strip().partition("-")
    try:
        if not dash:
            return None
        if first == "":  # the last N bytes
            n = int(last)
            return (max(size - n, 0), size - 1) if n > 0 and size > 0 else None
        a = int(first)
        b = size - 1 if last == "" else min(int(last), size - 1)
    except ValueError:
        return None
    return (a, b) if 0 <= a < size and a <= b else None


class _Reader:
    """Buffered reads from a socket: HTTP framing needs a head, exact counts and whatever has arrived."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def until(self, mark: bytes, limit: int = 1 << 16) -> Optional[bytes]:
        """Up to and including `mark`; None at a clean end of stream before any byte."""
        while (i := self.buf.find(mark)) < 0:
            if len(self.buf) > limit:
                raise ConnectionError("HTTP head too long")
            data = self.sock.recv(1 << 16)
            if not data:
                if self.buf:
                    raise ConnectionError("connection closed mid-message")
                return None
            self.buf += data
        out = bytes(self.buf[:i + len(mark)])
        del self.buf[:i + len(mark)]
        return out

    def some(self, n: int) -> bytes:
        if self.buf:
            out = bytes(self.buf[:n])
            del self.buf[:n]
            return out
        return self.sock.recv(min(n, 1 << 16))

    def pieces(self, n: int) -> Iterator[bytes]:
        while n > 0:
            piece = self.some(n)
            if not piece:
                raise ConnectionError("connection closed mid-body")
            n -= len(piece)
            yield piece

    def to_end(self) -> Iterator[bytes]:
        while piece := self.some(1 << 16):
            yield piece

    def chunked(self) -> Iterator[bytes]:
        """A chunked body as sent, framing and trailers included."""
        while True:
            line = self.until(b"\r\n")
            if line is None:
                raise ConnectionError("connection closed mid-body")
            yield line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while (trailer := self.until(b"\r\n")) not in (b"\r\n", None):
                    yield trailer
                yield b"\r\n"
                return
            yield from self.pieces(size + 2)


def _parse_head(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    first, *lines = raw.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = []
    for line in lines:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return first, headers


def _header(headers: list[tuple[str, str]], name: str) -> Optional[str]:
    found = [value for key, value in headers if key.lower() == name]
    return found[-1] if found else None


def _body(reader: _Reader, headers: list[tuple[str, str]], empty: bool = False,
          eof_delimited: bool = False) -> Iterator[bytes]:
    if empty:
        return iter(())
    if "chunked" in (_header(headers, "transfer-encoding") or "").lower():
        return reader.chunked()
    if (length := _header(headers, "content-length")) is not None:
        return reader.pieces(int(length))
    return reader.to_end() if eof_delimited else iter(())


def _head_bytes(first: str, headers: list[tuple[str, str]]) -> bytes:
    return "".join([f"{first}\r\n", *(f"{k}: {v}\r\n" for k, v in headers), "\r\n"]).encode("latin-1")


def _rst(sock: socket.socket) -> None:
    """Close with a TCP RST rather than a FIN: the client sees `connection reset`, not a clean end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
             b"request rate.</Message><RequestId>FAULTPROXY</RequestId><HostId>FAULTPROXY</HostId></Error>")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "expect", "te", "upgrade"}
_LOG_LIMIT = 100_000


class _Proxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.lock = threading.Lock()
        self.mode, self.cut_after, self.delay = "pass", 1024, 0.0
        self.pending = (0, "pass")  # fail_next: (requests left, mode)
        self.reset_stats()

    def reset_stats(self) -> None:
        with self.lock:
            self.stats = {"requests": 0, "bytes": 0, "faults": 0, "connections": 0, "upstream_errors": 0}
            self.log: list[dict] = []

    def control(self, message: dict) -> dict:
        op = message.get("op")
        with self.lock:
            if op in ("mode", "fail_next") and message.get("mode") not in MODES:
                return {"error": f"mode {message.get('mode')!r} is not one of {MODES}"}
            if op == "mode":
                self.mode, self.cut_after, self.delay = message["mode"], message["cut_after"], message["delay"]
                return {}
            if op == "fail_next":
                self.pending = (int(message["n"]), message["mode"])
                return {}
            if op == "stats":
                return {"stats": dict(self.stats)}
            if op == "log":
                return {"log": list(self.log)}
        if op == "reset_stats":
            self.reset_stats()
            return {}
        return {"error": f"unknown op {op!r}"}

    def take(self, entry: dict) -> tuple[str, int, float]:
        """The fault of the request whose head just arrived, counted."""
        with self.lock:
            left, pending_mode = self.pending
            if left > 0:
                self.pending = (left - 1, pending_mode)
                mode = pending_mode
            else:
                mode = self.mode
            self.stats["requests"] += 1
            self.stats["faults"] += mode != "pass"
            entry["fault"] = None if mode == "pass" else mode
            self.log.append(entry)
            del self.log[:-_LOG_LIMIT]
            return mode, self.cut_after, self.delay

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.stats[key] += n

    def serve_client(self, client: socket.socket) -> None:
        self.count("connections")
        reader = _Reader(client)
        try:
            while self.serve_request(client, reader):
                pass
        except (OSError, ValueError):  # the client went away, or spoke something else than HTTP/1.1
            pass
        finally:
            client.close()

    def serve_request(self, client: socket.socket, reader: _Reader) -> bool:
        """One request; whether the client connection stays open for the next."""
        head = reader.until(b"\r\n\r\n")
        if head is None:
            return False
        first, headers = _parse_head(head)
        method, target, version = first.split(" ", 2)
        entry = {"method": method, "path": target, "range": _header(headers, "range"), "status": None, "bytes": 0}
        mode, cut_after, delay = self.take(entry)
        expects = (_header(headers, "expect") or "").lower() == "100-continue"
        if mode == "reset":
            _rst(client)
            return False
        if mode == "stall":
            while client.recv(1 << 16):  # until the client gives up
                pass
            return False
        if mode == "503":
            if not expects:  # read it all, or closing with unread bytes would RST the 503 away
                for _ in _body(reader, headers):
                    pass
            body = b"" if method == "HEAD" else SLOW_DOWN
            client.sendall(_head_bytes("HTTP/1.1 503 Slow Down", [
                ("Content-Type", "application/xml"), ("Content-Length", str(len(body))), ("Connection", "close"),
                ("x-amz-request-id", "FAULTPROXY")]) + body)
            entry["status"] = 503
            return False
        if delay:
            time.sleep(delay)
        if expects:
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        request_body = b"".join(_body(reader, headers))
        keep_alive = version == "HTTP/1.1" and (_header(headers, "connection") or "").lower() != "close"
        return self.forward(client, method, first, headers, request_body, entry, keep_alive,
                            cut_after if mode == "cut" else None)

    def forward(self, client: socket.socket, method: str, first: str, headers: list[tuple[str, str]],
                request_body: bytes, entry: dict, keep_alive: bool, cut_after: Optional[int]) -> bool:
        try:
            upstream = socket.create_connection(self.upstream, timeout=60)
        except OSError:
            entry["status"] = "refused"
            self.count("upstream_errors")
            _rst(client)
            return False
        with upstream:
            try:
                upstream.sendall(_head_bytes(first, [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]
                                             + [("Connection", "close")]) + request_body)
                reader = _Reader(upstream)
                while True:  # skip interim 1xx answers
                    head = reader.until(b"\r\n\r\n")
                    if head is None:
                        raise ConnectionError("upstream closed without an answer")
                    status_line, response_headers = _parse_head(head)
                    status = int(status_line.split(" ", 2)[1])
                    if status >= 200 or status == 101:
                        break
            except OSError:
                entry["status"] = "dropped"
                self.count("upstream_errors")
                _rst(client)
                return False
            entry["status"] = status
            framed = method == "HEAD" or status in (204, 304) or any(
                _header(response_headers, name) is not None for name in ("content-length", "transfer-encoding"))
            keep_alive = keep_alive and framed
            kept = [(k, v) for k, v in response_headers if k.lower() not in _HOP_BY_HOP]
            client.sendall(_head_bytes(status_line, kept + ([] if keep_alive else [("Connection", "close")])))
            empty = method == "HEAD" or status in (204, 304)
            for piece in _body(reader, response_headers, empty=empty, eof_delimited=True):
                if cut_after is not None and entry["bytes"] + len(piece) >= cut_after:
                    piece = piece[:cut_after - entry["bytes"]]
                    client.sendall(piece)
                    entry["bytes"] += len(piece)
                    self.count("bytes", len(piece))
                    _rst(client)
                    return False
                client.sendall(piece)
                entry["bytes"] += len(piece)
                self.count("bytes", len(piece))
            return keep_alive

    def serve_control(self, listener: socket.socket) -> None:
        while True:
            connection, _ = listener.accept()
            with connection:
                line = connection.makefile("rb").readline()
                try:
                    answer = self.control(json.loads(line))
                except (ValueError, KeyError, TypeError) as e:
                    answer = {"error": repr(e)}
                connection.sendall(json.dumps(answer).encode() + b"\n")


def _serve_proxy(upstream: str, port: str) -> None:
    proxy = _Proxy(upstream)
    listener = socket.create_server((HOST, int(port)), backlog=128)
    control = socket.create_server((HOST, 0))
    threading.Thread(target=proxy.serve_control, args=(control,), daemon=True).start()
    _ready(listener.getsockname()[1], control.getsockname()[1])
    while True:
        client, _ = listener.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=proxy.serve_client, args=(client,), daemon=True).start()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.kill()


def main(argv: list[str]) -> None:
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # daemon threads blocked in accept() do not stop exit
    commands = {"moto": _serve_moto, "http-serve": _serve_folder, "gcs": _serve_gcs, "proxy": _serve_proxy}
    if not argv or argv[0] not in commands:
        sys.exit(f"usage: {sys.argv[0]} moto PORT | http-serve FOLDER PORT | gcs PORT | proxy HOST:PORT PORT")
    commands[argv[0]](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])

"""`imagenet-elastic pack SRC OUT`: ImageNet as tar shards with an index, the packed form a cluster trains from.

SRC is anything the trainer reads, including Hugging Face imagenet-1k parquet files (the `parquet` extra). OUT gets
`train/` and `val/` of WebDataset shards, each with its index written last, a `classes.txt` and `pack.json`. Output
depends on the input and the options alone, whatever the process count. An interrupted pack leaves complete shards
and no index: a rerun with the same source and options keeps them and writes the rest; anything else in OUT is
refused. OUT may be a store's URL (`s3://...`): the pack is staged in the node's store cache (it needs the room), then
uploaded with indexes and pack.json last, so the store holds a complete pack only once every shard is there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from imagenet_elastic.atomic_files import TEMP_PREFIX, atomic_write_bytes
from imagenet_elastic.data import sources
from imagenet_elastic.data.sources import object_store, tar_shards
from imagenet_elastic.errors import PROG, UserError, report
from imagenet_elastic.options import HelpFormatter, Parser, positive_int
from imagenet_elastic.tools.pack_shard import Options, Split, Written, shard_name, write_shard

PACK_FILE = tar_shards.PACK_FILE
PACK_VERSION = 1


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic pack", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("src", metavar="SRC", help="what the trainer reads as DATA: a data root (train/ and val/), a folder "
                   "of imagenet-1k parquet files, ...")
    p.add_argument("out", metavar="OUT", help="a new or empty folder (or an interrupted pack of the same SRC)")
    p.add_argument("--val-path", metavar="PATH", help="the validation split, as the trainer's --val-path")
    p.add_argument("--val-labels", metavar="FILE", help="the classes of a flat validation folder, as the trainer's")
    p.add_argument("--max-side", type=positive_int, metavar="N",
                   help="resize images larger than N pixels on their longer side (FFCV: 256 to 512); default: keep all")
    p.add_argument("--quality", type=int, choices=range(1, 101), metavar="Q", default=90,
                   help="JPEG quality of the images --max-side resizes")
    p.add_argument("--shard-size", type=positive_int, metavar="N", default=1024, help="samples per shard")
    p.add_argument("--workers", type=positive_int, metavar="N", help="processes writing shards (default: the cores)")
    return p


def source_splits(src: str, val_path: Optional[str], val_labels: Optional[str]) -> list[Split]:
    train, val = sources.open_splits(src, val_path, val_labels, cache_dir=None)
    for note in (*train.notes, *val.notes):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    return [Split(s.role, len(s), s.classes, s.where(), s) for s in (train, val)]


def _write_shard_task(task: tuple[str, int, Split, Options]) -> Written:
    """In a pool worker; its UserError reaches the parent, which reports it as one line."""
    return write_shard(*task)


def check_out(out: str, record: dict[str, Any]) -> bool:
    """Whether OUT may be written: new, empty, or an interrupted pack of the same source and options (True:
    continue it). A complete pack or anything else is refused."""
    if not os.path.exists(out):
        return False
    if not os.path.isdir(out):
        raise UserError(f"pack: OUT {out} exists and is not a folder")
    present = os.listdir(out)
    if not present:
        return False
    marker = os.path.join(out, PACK_FILE)
    if not os.path.isfile(marker):
        raise UserError(f"pack: OUT {out} is not empty ({sorted(present)[0]} ...): choose a new or empty folder")
    try:
        with open(marker) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"pack: {marker} is damaged: remove {out} to pack again") from None
    if previous.get("complete"):
        raise UserError(f"pack: OUT {out} already holds a complete pack of {previous.get('source')}")
    same = {k: previous.get(k) for k in ("source", "options", "splits")} == {k: record[k] for k in
                                                                             ("source", "options", "splits")}
    if not same:
        raise UserError(f"pack: OUT {out} holds an interrupted pack of {previous.get('source')} with other options "
                        f"({previous.get('options')}): remove it, or rerun that pack")
    return True


def done_shards(folder: str, split: Split, options: Options) -> dict[int, tar_shards.Found]:
    """The shards an interrupted pack completed (whole, by their walk); temp files it left are removed."""
    done: dict[int, tar_shards.Found] = {}
    if not os.path.isdir(folder):
        return done
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(TEMP_PREFIX):
            os.unlink(path)
            continue
        if not (name.startswith("shard-") and name.endswith(".tar")):
            continue
        k = int(name[len("shard-"):-len(".tar")])
        expected = min(split.count, (k + 1) * options.shard_size) - k * options.shard_size
        try:
            found = tar_shards.walk_shard(path, split.role, checksums=True)
        except UserError:
            found = None
        if found is not None and len(found.labels) == expected:
            done[k] = found
        else:
            os.unlink(path)  # cut short, or of another shard size: written again
    return done


class Progress:
    """Images per second and the time left: a bar on a terminal, a line every 10% in a log."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start, self.next_line = total, 0, time.perf_counter(), 0.1
        self.bar = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("packing"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("pack", total=total, rate="")

    def add(self, images: int) -> None:
        self.done += images
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, rate=f"{rate:.0f} img/s")
        elif self.done >= self.next_line * self.total or self.done == self.total:
            left = (self.total - self.done) / max(rate, 1e-9)
            print(f"packed {self.done}/{self.total} images, {rate:.0f} img/s, {left:.0f} s left", flush=True)
            self.next_line = math.floor(10 * self.done / self.total + 1) / 10

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def pack(src: str, out: str, args: argparse.Namespace) -> dict[str, Any]:
    options = Options(args.max_side, args.quality, args.shard_size)
    splits = source_splits(src, args.val_path, args.val_labels)
    record = {"version": PACK_VERSION, "source": os.path.abspath(src), "options": options.as_dict(),
              "splits": {s.role: {"samples": s.count, "from": s.where} for s in splits}, "complete": False}
    continuing = check_out(out, record)
    os.makedirs(out, exist_ok=True)
    atomic_write_bytes(json.dumps(record, indent=1).encode(), os.path.join(out, PACK_FILE))
    tasks, total = [], 0
    found: dict[str, dict[int, tar_shards.Found]] = {}
    for split in splits:
        folder = os.path.join(out, split.role)
        os.makedirs(folder, exist_ok=True)
        found[split.role] = done_shards(folder, split, options) if continuing else {}
        for k in range(math.ceil(split.count / options.shard_size)):
            if k not in found[split.role]:
                tasks.append((folder, k, split, options))
                total += min(split.count, (k + 1) * options.shard_size) - k * options.shard_size
    began = time.perf_counter()
    workers = min(args.workers or len(os.sched_getaffinity(0)), max(1, len(tasks)))
    resized = 0
    # fork the pool before the progress bar's refresh thread starts: a fork beside a running thread can leave a lock
    # it held (stdout's, rich's) held for ever in the child (CPython gh-112275)
    with ShardPool(workers, tasks) as written_shards:
        progress = Progress(total)
        try:
            for written in written_shards:
                found[written.role][written.k] = written.found
                resized += written.resized
                progress.add(len(written.found.labels))
        finally:
            progress.close()
    seconds = time.perf_counter() - began
    atomic_write_bytes("".join(f"{name}\n" for name in splits[0].classes).encode(),
                       os.path.join(out, tar_shards.CLASSES_FILE))
    for split in splits:  # the index last: a pack without it is not complete
        folder = os.path.join(out, split.role)
        index = tar_shards.assemble(folder, split.role, [os.path.join(folder, shard_name(k)) for k in
                                                         sorted(found[split.role])],
                                    [found[split.role][k] for k in sorted(found[split.role])], split.classes)
        tar_shards.write_index(index, os.path.join(folder, tar_shards.INDEX_NAME), relative_to=folder)
    atomic_write_bytes(json.dumps({**record, "complete": True}, indent=1).encode(), os.path.join(out, PACK_FILE))
    return {"out": out, "images": total, "seconds": round(seconds, 1),
            "images_per_sec": round(total / seconds, 1) if seconds else None, "workers": workers,
            "resized": resized, **options.as_dict(),
            "bytes": sum(os.path.getsize(os.path.join(out, s.role, n)) for s in splits
                         for n in os.listdir(os.path.join(out, s.role)) if n.endswith(".tar"))}


class ShardPool:
    """The shards written by `workers` forked processes, as they complete (in this process for one worker).

    Ctrl-C reaches every process of the group: workers ignore it (SIGINT is blocked while they fork) and the parent
    stops. Its handler only sets a flag, turned into KeyboardInterrupt between two waits: raised anywhere, it could
    leave a concurrent.futures lock held and a thread hung on it. An error kills the workers: concurrent.futures'
    pool survives that, where multiprocessing.Pool.terminate() can hang on a lock a killed worker held (gh-96995)."""

    def __init__(self, workers: int, tasks: list[tuple[str, int, Split, Options]]) -> None:
        self.workers, self.tasks = workers, tasks
        self.executor: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self.futures: list[concurrent.futures.Future[Written]] = []
        self.interrupted = False
        self._previous: Optional[tuple[Any]] = None  # SIGINT's handler before the pool's, where the pool set one

    def __enter__(self) -> ShardPool:
        if self.workers > 1:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:  # the first submit forks every worker, before the pool's own thread starts
                self.executor = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("fork"),
                    initializer=_leave_interrupts_to_the_parent)
                self.futures = [self.executor.submit(_write_shard_task, task) for task in self.tasks]
                if threading.current_thread() is threading.main_thread():
                    self._previous = (signal.signal(signal.SIGINT, self._interrupt),)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return self

    def _interrupt(self, _signum: int, _frame: Any) -> None:
        self.interrupted = True

    def __iter__(self) -> Iterator[Written]:
        if self.executor is None:
            yield from map(_write_shard_task, self.tasks)
            return
        pending = set(self.futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, 0.1, concurrent.futures.FIRST_COMPLETED)
            if self.interrupted:
                raise KeyboardInterrupt
            for future in done:
                yield future.result()

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self.executor is None:
            return
        try:
            if kind is not None:
                for future in self.futures:
                    future.cancel()
                kill = getattr(self.executor, "kill_workers", None)  # Python 3.14
                if kill is not None:
                    kill()
                else:
                    for process in list(self.executor._processes.values()):
                        process.kill()
            self.executor.shutdown(wait=True, cancel_futures=True)
        finally:
            if self._previous is not None:
                signal.signal(signal.SIGINT, self._previous[0])
        if self.interrupted and kind is None:  # a Ctrl-C after the last shard's wait
            raise KeyboardInterrupt


def _leave_interrupts_to_the_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def staging(out: str) -> str:
    """The local staging folder for the store's `out`: the same for the same URL on a node, so a rerun continues it."""
    digest = hashlib.blake2b(out.encode(), digest_size=8).hexdigest()
    return os.path.join(object_store.settings().cache, f"pack-{digest}")


def upload(staged: str, out: str) -> dict[str, int]:
    """Every staged file to the store at `out`, indexes and pack.json last; objects there at their size are skipped."""
    timeout = object_store.settings().timeout
    files = sorted(os.path.relpath(os.path.join(root, name), staged) for root, _, names in os.walk(staged)
                   for name in names if not name.startswith(TEMP_PREFIX))
    last = (tar_shards.INDEX_NAME, PACK_FILE)
    ordered = sorted(files, key=lambda name: (os.path.basename(name) in last, os.path.basename(name) == PACK_FILE))
    sent = kept = 0
    for name in ordered:
        local, url = os.path.join(staged, name), object_store.join(out, *name.split(os.sep))
        found = object_store.find(url, timeout)
        if found is not None and found.size == os.path.getsize(local) and os.path.basename(name) not in last:
            kept += 1
            continue
        object_store.write_file(local, url, timeout)
        sent += 1
    return {"uploaded": sent, "already_there": kept}


def pack_to_store(src: str, out: str, args: argparse.Namespace) -> dict[str, Any]:
    if object_store.scheme(out) in ("http", "https"):
        raise UserError(f"pack: OUT {out}: an https:// server cannot be written to; pack to a folder and publish it")
    timeout = object_store.settings().timeout
    marker = object_store.find(object_store.join(out, PACK_FILE), timeout)
    if marker is not None and json.loads(object_store.read_whole(marker.url, timeout)).get("complete"):
        raise UserError(f"pack: OUT {out} already holds a complete pack")
    staged = staging(out)
    result = pack(src, staged, args) if not _complete(staged) else {"images": 0, "out": staged}
    result = {**result, **upload(staged, out), "out": out}
    shutil.rmtree(staged, ignore_errors=True)
    return result


def _complete(folder: str) -> bool:
    try:
        with open(os.path.join(folder, PACK_FILE)) as f:
            return bool(json.load(f).get("complete"))
    except (OSError, ValueError):
        return False


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    try:
        result = (pack_to_store if object_store.is_url(args.out) else pack)(args.src, args.out, args)
    except KeyboardInterrupt:  # the shard in flight is a temp file, which the same command removes and writes again
        print(f"{PROG}: pack interrupted: the same command keeps the complete shards in {args.out} and writes the "
              "rest", file=sys.stderr, flush=True)
        sys.exit(130)
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)
    except concurrent.futures.BrokenExecutor:
        report(UserError(f"pack: a process writing shards died (killed, or out of memory): the same command keeps "
                         f"the complete shards in {args.out} and writes the rest"), rank=0)
        sys.exit(1)
    except OSError as error:
        report(UserError(f"pack: {error.strerror or error} ({error.filename or args.out})"), rank=0)
        sys.exit(74)
    print(json.dumps(result), flush=True)



"""`imagenet-elastic pack SRC OUT`: ImageNet as tar shards with an index, the packed form a cluster trains from.

What OUT holds, how an interrupted pack is continued and how one goes to a store's URL: docs/DATA.md ("Packs").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tarfile
import threading
import time
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from imagenet_elastic.atomic_files import TEMP_PREFIX, atomic_write_bytes, commit, nearest_existing, write_temp
from imagenet_elastic.data import sources
from imagenet_elastic.data.sources import object_store, tar_shards
from imagenet_elastic.errors import PROG, UNIDENTIFIED_IMAGE, UserError, report
from imagenet_elastic.options import HelpFormatter, Parser, bounded, jpeg_side, positive_int

PACK_FILE = tar_shards.PACK_FILE
PACK_VERSION = 1


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic pack", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("src", metavar="SRC", help="what the trainer reads as DATA: a data root (train/ and val/), a folder "
                   "of imagenet-1k parquet files, ...")
    p.add_argument("out", metavar="OUT", help="a new or empty folder (or an interrupted pack of the same SRC)")
    p.add_argument("--val-path", metavar="PATH", help="the validation split, as the trainer's --val-path")
    p.add_argument("--val-labels", metavar="FILE", help="the classes of a flat validation folder, as the trainer's")
    p.add_argument("--max-side", type=jpeg_side, metavar="N",
                   help="resize images larger than N pixels on their longer side (FFCV: 256 to 512); default: keep all")
    p.add_argument("--quality", type=bounded(int, 1, 100), metavar="Q", default=90,
                   help="JPEG quality of the images --max-side resizes")
    p.add_argument("--shard-size", type=positive_int, metavar="N", default=1024, help="samples per shard")
    p.add_argument("--workers", type=bounded(int, 1, 128), metavar="N",
                   help="processes writing shards (default: the cores)")
    return p


@dataclass(frozen=True)
class Options:
    max_side: Optional[int]
    quality: int
    shard_size: int

    def shard(self, k: int, count: int) -> range:
        """The samples of shard k of a split of `count`."""
        return range(k * self.shard_size, min(count, (k + 1) * self.shard_size))


def samples(split: sources.Source, start: int, stop: int) -> Iterator[tuple[str, bytes, int]]:
    """(name, bytes, label) of samples [start, stop), bytes first (a parquet source names a sample after reading it).
    tests/pack_held.py holds a pack in the middle here."""
    for i in range(start, stop):
        raw = split.read(i)
        yield split.name(i), raw, split.label(i)


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.tar"


def member_key(i: int, name: str) -> str:
    """A sample's key: its number, then its file name without dots (WebDataset's key ends at the first dot), so keys
    are unique and say where the sample came from."""
    stem = os.path.splitext(os.path.basename(name.rsplit(":", 1)[-1]))[0]
    readable = "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)[:80]
    return f"{i:08d}_{readable}" if readable else f"{i:08d}"


EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}  # the formats a shard's reader takes


def stored_image(raw: bytes, name: str, options: Options) -> tuple[bytes, str, int]:
    """(bytes, extension, 1 if resized) of one image: kept once it decoded, or resized to --max-side and encoded.
    A file that cannot be decoded is refused, so a pack holds no image that training would meet as corrupt. A BMP,
    TIFF, ... becomes a PNG of the pixels training sees: under `.jpg`, a reader would send it to a JPEG decoder."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as img:
            kind, (width, height) = img.format, img.size
            if options.max_side is None or max(width, height) <= options.max_side:
                # decoded to the end of its data, so a damaged file raises here as training's decode would: a JPEG at
                # 1/8 scale (Pillow's draft mode reads every entropy-coded block, only the inverse DCT is smaller;
                # `verify()` reads only a JPEG's header)
                if kind == "JPEG":
                    img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
                img.load()
                if kind in EXTENSIONS:
                    return raw, EXTENSIONS[kind], 0
                out = io.BytesIO()
                (img if img.mode in ("L", "RGB") else img.convert("RGB")).save(out, format="PNG")
                return out.getvalue(), "png", 0
            scale = options.max_side / max(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            resized = img.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    except Image.UnidentifiedImageError:
        raise UserError(f"pack: cannot decode image {name}: {UNIDENTIFIED_IMAGE}") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise UserError(f"pack: cannot decode image {name}: {error}") from None
    out = io.BytesIO()
    resized.save(out, format="JPEG", quality=options.quality)
    return out.getvalue(), "jpg", 1


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A member whose header depends on its name and size alone: no time, owner or mode of this machine."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o644, 0, 0, "", ""
    tar.addfile(info, io.BytesIO(data))


Written = tuple[str, int, tar_shards.Found, int]  # a shard on disk: role, k, its index entries, images re-encoded


def write_shard(folder: str, k: int, split: sources.Source, options: Options) -> Written:
    """Shard k of a split, its bytes depending on the input and the options alone, under a temporary name until it
    is complete, then walked for its index. In a pool worker, its UserError reaches the parent as one line."""
    span = options.shard(k, len(split))
    resized = 0

    def write(file: Any) -> None:
        nonlocal resized
        with tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i, (name, raw, label) in enumerate(samples(split, span.start, span.stop), start=span.start):
                if not 0 <= label < len(split.classes):
                    raise UserError(f"pack: {name} has label {label}, out of range for {len(split.classes)} classes")
                data, extension, changed = stored_image(raw, name, options)
                resized += changed
                key = member_key(i, name)
                add_member(tar, f"{key}.{extension}", data)
                add_member(tar, f"{key}.{tar_shards.LABEL_EXTENSION}", f"{label}".encode())

    path = os.path.join(folder, shard_name(k))
    commit(write_temp(folder, shard_name(k), write), path)
    return split.role, k, tar_shards.walk_shard(path, split.role, checksums=True), resized


def check_out(out: str, record: dict[str, Any], source_then: str) -> bool:
    """Whether OUT may be written: new, empty, or an interrupted pack of the same source and options (True:
    continue it). A complete pack or anything else is refused. `source_then`: the source as an older pack.json
    recorded it (not real)."""
    if not os.path.isdir(existing := nearest_existing(out)):  # OUT, or a folder it would be made in
        raise UserError(f"pack: OUT {out}: {existing} is not a folder")
    if not os.path.exists(out):
        return False
    present = os.listdir(out)
    if not present:
        return False
    marker, previous = os.path.join(out, PACK_FILE), tar_shards.pack_record(out)
    if not os.path.isfile(marker):
        raise UserError(f"pack: OUT {out} is not empty ({sorted(present)[0]} ...): choose a new or empty folder")
    if previous is None:  # unreadable, or JSON that is no record
        raise UserError(f"pack: {marker} is damaged: remove {out} to pack again")
    if previous.get("complete"):
        raise UserError(f"pack: OUT {out} already holds a complete pack of {previous.get('source')}")
    if previous.get("source") not in (record["source"], source_then) or previous.get("options") != record["options"]:
        raise UserError(f"pack: OUT {out} holds an interrupted pack of {previous.get('source')} with options "
                        f"{previous.get('options')}: remove it, or rerun that pack")
    splits = previous.get("splits") if isinstance(previous.get("splits"), dict) else {}
    for role, now in record["splits"].items():
        then = splits.get(role) if isinstance(splits.get(role), dict) else {}
        if then.get("samples") != now["samples"] or resolved(str(then.get("from"))) != now["from"]:
            raise UserError(f"pack: OUT {out} holds an interrupted pack of {record['source']} whose {role} split has "
                            f"changed since: {then.get('samples')} samples in {then.get('from')} then, "
                            f"{now['samples']} in {now['from']} now: remove it to pack the source as it is now")
    return True


def done_shards(folder: str, split: sources.Source, options: Options) -> dict[int, tar_shards.Found]:
    """The shards an interrupted pack completed (whole, by their walk); temp files it left are removed."""
    done: dict[int, tar_shards.Found] = {}
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(TEMP_PREFIX):
            os.unlink(path)
        elif name.startswith("shard-") and name.endswith(".tar"):
            number = name[len("shard-"):-len(".tar")]
            if not (number.isascii() and number.isdigit()) or shard_name(int(number)) != name:  # a copy, or not ours
                raise UserError(f"pack: {path} is no shard this pack wrote: move it out of {folder} and rerun")
            k = int(number)
            try:
                found = tar_shards.walk_shard(path, split.role, checksums=True)
            except UserError:
                found = None
            if found is not None and len(found.labels) == len(options.shard(k, len(split))):
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


def real(location: Optional[str]) -> Optional[str]:
    """A location with its path made absolute and real, so that pack.json records the same input the same way from
    any directory (a URL as it is)."""
    if location is None:
        return None
    prefix, path = sources.kind_of(location)
    return location if object_store.is_url(path) else sources.prefixed(prefix, os.path.realpath(path))


def resolved(where: str) -> str:
    """A split's place as an older pack.json recorded it (`data/train`, `val (labels from v.csv)`), its paths resolved
    from here, to compare with where() of a split opened at real() locations."""
    path, sep, rest = where.partition(" (")
    labels = "labels from "
    if rest.startswith(labels) and rest.endswith(")"):
        rest = f"{labels}{real(rest[len(labels):-1])})"
    return f"{real(path)}{sep}{rest}"


def check_class_names(classes: Sequence[str]) -> None:
    """classes.txt holds a name a line: a name with a line break (or another control character) would shift every
    name after it, and the trained model would give each image its neighbour's name."""
    for name in classes:
        if any(unicodedata.category(c) == "Cc" or c in "\u2028\u2029" for c in name):
            raise UserError(f"pack: class {name!r} has a control character or line break: rename it")


def pack(src: str, out: str, args: argparse.Namespace) -> dict[str, Any]:
    options = Options(args.max_side, args.quality, args.shard_size)
    sources.check_apart(out, "pack: OUT", sources.split_locations(src, args.val_path), containing=True)
    splits = sources.open_splits(real(src), real(args.val_path), real(args.val_labels), cache_dir=None)
    check_class_names(splits[0].classes)
    for note in (*splits[0].notes, *splits[1].notes):
        if f"`{PROG} pack`" in note:  # advice for training from the source (parquet's): to pack it, as this does
            continue
        print(f"warning: {note}", file=sys.stderr, flush=True)
    record = {"version": PACK_VERSION, "source": real(src), "options": dataclasses.asdict(options),
              "val_path": real(args.val_path), "val_labels": real(args.val_labels),
              "splits": {s.role: {"samples": len(s), "from": s.where()} for s in splits}, "complete": False}
    continuing = check_out(out, record, os.path.abspath(src))
    os.makedirs(out, exist_ok=True)
    atomic_write_bytes(json.dumps(record, indent=1).encode(), os.path.join(out, PACK_FILE))
    tasks, total = [], 0
    found: dict[str, dict[int, tar_shards.Found]] = {}
    for split in splits:
        folder = os.path.join(out, split.role)
        os.makedirs(folder, exist_ok=True)
        found[split.role] = done_shards(folder, split, options) if continuing else {}
        for k in range(math.ceil(len(split) / options.shard_size)):
            if k not in found[split.role]:
                tasks.append((folder, k, split, options))
                total += len(options.shard(k, len(split)))
    began = time.perf_counter()
    workers = min(args.workers or len(os.sched_getaffinity(0)), max(1, len(tasks)))
    resized = 0
    # fork the pool before the progress bar's refresh thread starts: a fork beside a running thread can leave a lock
    # it held (stdout's, rich's) held for ever in the child (CPython gh-112275)
    with shard_pool(workers, tasks) as written_shards, contextlib.closing(Progress(total)) as progress:
        for role, k, walked, changed in written_shards:
            found[role][k] = walked
            resized += changed
            progress.add(len(walked.labels))
    seconds = time.perf_counter() - began
    atomic_write_bytes("".join(f"{name}\n" for name in splits[0].classes).encode(),
                       os.path.join(out, tar_shards.CLASSES_FILE))
    for split in splits:  # the index last: a pack without it is not complete
        folder, shards = os.path.join(out, split.role), sorted(found[split.role].items())
        index = tar_shards.assemble(folder, split.role, [os.path.join(folder, shard_name(k)) for k, _ in shards],
                                    [walked for _, walked in shards], split.classes)
        tar_shards.write_index(index, os.path.join(folder, tar_shards.INDEX_NAME), relative_to=folder)
    atomic_write_bytes(json.dumps({**record, "complete": True}, indent=1).encode(), os.path.join(out, PACK_FILE))
    return {"out": out, "images": total, "seconds": round(seconds, 1),
            "images_per_sec": round(total / seconds, 1) if seconds else None, "workers": workers,
            "resized": resized, **dataclasses.asdict(options),
            "bytes": sum(os.path.getsize(os.path.join(out, s.role, n)) for s in splits
                         for n in os.listdir(os.path.join(out, s.role)) if n.endswith(".tar"))}


@contextlib.contextmanager
def shard_pool(workers: int, tasks: list[tuple[str, int, sources.Source, Options]]) -> Iterator[Iterator[Written]]:
    """The shards written by `workers` forked processes, as they complete (in this process for one worker).

    Ctrl-C reaches every process of the group: workers ignore it (SIGINT is blocked while they fork) and the parent
    stops. Its handler only sets a flag, turned into KeyboardInterrupt between two waits: raised anywhere, it could
    leave a concurrent.futures lock held and a thread hung on it. An error kills the workers: concurrent.futures'
    pool survives that, where multiprocessing.Pool.terminate() can hang on a lock a killed worker held (gh-96995)."""
    if workers == 1:
        yield itertools.starmap(write_shard, tasks)
        return
    interrupted: list[bool] = []  # the flag SIGINT's handler sets
    previous = None  # SIGINT's handler before the pool's, where the pool set one
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:  # the first submit forks every worker, before the pool's own thread starts
        executor = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                                          initializer=_leave_interrupts_to_the_parent)
        futures = [executor.submit(write_shard, *task) for task in tasks]
        if threading.current_thread() is threading.main_thread():
            previous = (signal.signal(signal.SIGINT, lambda *_: interrupted.append(True)),)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def written() -> Iterator[Written]:
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, 0.1, concurrent.futures.FIRST_COMPLETED)
            if interrupted:
                raise KeyboardInterrupt
            for future in done:
                yield future.result()

    failed = True
    try:
        yield written()
        failed = False
    finally:
        try:
            if failed:
                for future in futures:
                    future.cancel()
                kill = getattr(executor, "kill_workers", None)  # Python 3.14
                if kill is not None:
                    kill()
                else:
                    for process in list(executor._processes.values()):
                        process.kill()
            executor.shutdown(wait=True, cancel_futures=True)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous[0])
    if interrupted:  # a Ctrl-C after the last shard's wait
        raise KeyboardInterrupt


def _leave_interrupts_to_the_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def upload(staged: str, out: str) -> dict[str, int]:
    """Every staged file to the store at `out`: first a pack.json that calls the pack unfinished (a split read before
    the upload ends is refused, as on disk), the indexes and the whole pack.json last; objects there at their size are
    skipped."""
    timeout = object_store.settings().timeout
    unfinished = {**(tar_shards.pack_record(staged) or {}), "complete": False}
    object_store.write_bytes(json.dumps(unfinished, indent=1).encode(), object_store.join(out, PACK_FILE), timeout)
    last = (tar_shards.INDEX_NAME, PACK_FILE)
    files = sorted((os.path.relpath(os.path.join(root, name), staged) for root, _, names in os.walk(staged)
                    for name in names if not name.startswith(TEMP_PREFIX)),
                   key=lambda name: (os.path.basename(name) in last, os.path.basename(name) == PACK_FILE, name))
    sent = kept = 0
    for name in files:
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
    settings = object_store.settings()
    marker = object_store.find(object_store.join(out, PACK_FILE), settings.timeout)
    if marker is not None:
        previous = tar_shards.as_pack_record(object_store.read_whole(marker.url, settings.timeout))
        if previous is None:
            raise UserError(f"pack: {marker.url} is damaged: remove it to pack again")
        if previous.get("complete"):
            raise UserError(f"pack: OUT {out} already holds a complete pack")
    # staged in a folder that is the same for the same URL on a node, so a rerun continues it
    staged = os.path.join(settings.cache, f"pack-{hashlib.blake2b(out.encode(), digest_size=8).hexdigest()}")
    staged_whole = (tar_shards.pack_record(staged) or {}).get("complete")
    result = {"images": 0, "out": staged} if staged_whole else pack(src, staged, args)
    result = {**result, **upload(staged, out), "out": out}
    shutil.rmtree(staged, ignore_errors=True)
    return result


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



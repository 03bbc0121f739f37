"""One job: every rank trains on the same data, settings, code and checkpoint, or none starts. Node-local copies
differing by a file, a stale package on some nodes, a node-local checkpoints folder would each train without error
while the sampler's images, exact resume or a re-formed job's restart silently go wrong. So once the process group
forms, each rank sends a fingerprint of a few hundred bytes (one all-gather); a difference ends every rank with one
line naming it, before any work or write. Only then do the ranks exchange more, to name the first differing setting
or file."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from imagenet_elastic import __version__
from imagenet_elastic.config import Config, flag
from imagenet_elastic.data.sources import FileList, Source
from imagenet_elastic.errors import UserError
from imagenet_elastic.launch import distributed

# Settings each node may set its own way; the checkpoints folder is compared by its lock's token, not its path.
NODE_LOCAL = frozenset({"data", "val_path", "val_labels", "checkpoints_path", "workers", "threads", "log_interval",
                        "tensorboard", "wandb", "mlflow", "dist_init_method", "nproc_per_node", "master_port",
                        "dist_url", "dist_timeout"})


class JobMismatch(UserError):
    """Ranks that differ in what they must share. Every node's log says it (see launch/processes.py)."""

    every_node = True


@dataclass(frozen=True)
class Fingerprint:
    """What a rank must share with the others, compared in field order: the first difference explains the rest."""

    software: str
    settings: str  # digest of the settings that are not NODE_LOCAL
    folder_token: Optional[str]  # the lock token this rank reads in its --checkpoints-path
    checkpoint: Optional[tuple[int, int, float]]  # (step, samples, saved_at) of the checkpoint it resumes
    train: FileList
    val: FileList
    host: str  # not compared: named in messages
    folder: str  # idem: the checkpoints folder, as this rank names it
    teacher: Optional[str] = None  # the SHA-256 of the --teacher weights this rank read (from its node's cache)


def code_version() -> str:
    """Version and a digest of the package's source: an edited or stale checkout has the same version."""
    digest = hashlib.blake2b(digest_size=6)
    package = Path(__file__).parents[1]  # the whole package, its subpackages too
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return f"imagenet_elastic {__version__} (source {digest.hexdigest()}), torch {torch.__version__}"


def shared_settings(config: Config) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in NODE_LOCAL}


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(settings, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


def first_difference(prints: list[Fingerprint]) -> Optional[tuple[str, list[int]]]:
    """The first compared field in which a rank differs from rank 0, and every rank that does."""
    for name in (f.name for f in fields(Fingerprint) if f.name not in ("host", "folder")):
        ranks = [r for r, p in enumerate(prints) if getattr(p, name) != getattr(prints[0], name)]
        if ranks:
            return name, ranks
    return None


def setting_differences(mine: dict[str, Any], main: dict[str, Any], rank: int) -> list[str]:
    """`--flag is A on rank 0 but B on rank N` for each setting in which `mine` differs from rank 0's."""
    by_name = {f.name: f for f in fields(Config)}
    return [f"{flag(by_name[k]) if k in by_name else k} is {main.get(k)!r} on rank 0 but {mine.get(k)!r} on rank {rank}"
            for k in sorted(set(mine) | set(main)) if mine.get(k) != main.get(k)]


def listing(source: Source) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """What rank 0 sends when file lists differ: class names, entries and labels."""
    return source.classes, source.entries(), source.labels


def _text(entry: bytes) -> str:
    return f"'{entry.decode(errors='backslashreplace')}'"  # quoted; a file name's bytes need not be UTF-8


def first_file_difference(mine: Source, main: tuple[tuple[str, ...], np.ndarray, np.ndarray], rank: int) -> str:
    """Where this rank's list departs from rank 0's: the first differing entry, or where one list ends."""
    classes, entries, labels = main
    own, own_labels = mine.entries(), mine.labels
    if tuple(mine.classes) != tuple(classes):
        return (f"classes only on rank 0: {sorted(set(classes) - set(mine.classes))[:3]}, only on rank {rank}: "
                f"{sorted(set(mine.classes) - set(classes))[:3]}")
    common = min(len(entries), len(own))
    differs = np.flatnonzero((entries[:common] != own[:common]) | (labels[:common] != own_labels[:common]))
    if len(differs):
        i = int(differs[0])
        return f"image #{i} is {_text(entries[i])} on rank 0 but {_text(own[i])} on rank {rank}"
    if len(entries) == len(own):
        return "the lists are the same"  # rank 0, and others not asked
    longer, name = (entries, "rank 0") if len(entries) > common else (own, f"rank {rank}")
    return f"the lists agree up to image #{common}, where only {name} goes on, with {_text(longer[common])}"


def describe(name: str, ranks: list[int], prints: list[Fingerprint], config: Config, train: Source, val: Source) -> str:
    """The line saying what differs; a collective where fingerprints cannot say it (all ranks call it alike)."""
    first, main, other = ranks[0], prints[0], prints[ranks[0]]
    zero = f"rank 0 ({main.host})"
    them = f"rank {first} ({other.host})" + (f" (and {len(ranks) - 1} other rank(s))" if len(ranks) > 1 else "")
    if name == "software":
        return (f"ranks run different code: {zero} runs {main.software}, {them} runs {other.software}; install the "
                "same version on every node")
    if name == "settings":
        main_settings = distributed.broadcast_object(shared_settings(config), src=0)
        found = distributed.broadcast_object(
            setting_differences(shared_settings(config), main_settings, distributed.rank()), src=first)
        return (f"ranks were started with different settings: {zero} against {them}: {'; '.join(found[:3])}; give "
                "every node the same command line")
    if name == "folder_token":
        return (f"the checkpoints folder is not shared: {them} does not see the lock that {zero} holds in "
                f"{main.folder} (it looks in {other.folder}). --checkpoints-path must be on storage that every node "
                "shares: otherwise only one node has the checkpoints, and a job that re-forms with rank 0 on another "
                "node starts over from nothing")
    if name == "teacher":
        return (f"ranks read different weights for --teacher {config.teacher}: {zero} sha256 {str(main.teacher)[:12]}, "
                f"{them} {str(other.teacher)[:12]}; every node's copy (its Hugging Face cache, its file) must hold "
                "the same weights")
    if name == "checkpoint":
        said = ["no checkpoint" if p.checkpoint is None else f"the checkpoint of step {p.checkpoint[0]}"
                for p in (main, other)]
        return (f"ranks loaded different checkpoints from {main.folder}: {zero} found {said[0]}, {them} {said[1]} "
                "(was it written to while this round started?)")
    index, ours, theirs = (train if name == "train" else val), getattr(main, name), getattr(other, name)
    listed = distributed.broadcast_object(listing(index) if distributed.rank() == 0 else None, src=0)
    detail = distributed.broadcast_object(first_file_difference(index, listed, distributed.rank()), src=first)
    return (f"{name} file lists differ: {zero} has {ours.count} images in {ours.classes} classes, {them} "
            f"{theirs.count} in {theirs.classes}; {detail}. Node-local copies of the data must be identical")


def check_same_job(config: Config, train: Source, val: Source, folder_token: Optional[str],
                   checkpoint: Optional[dict[str, Any]], teacher: Optional[str] = None) -> None:
    """One all-gather of the ranks' fingerprints; JobMismatch on every rank when they differ."""
    mark = (int(checkpoint["step"]), int((checkpoint.get("epoch_progress") or {}).get("samples", 0)),
            float(checkpoint["saved_at"])) if checkpoint is not None else None
    prints = distributed.all_gather_object(Fingerprint(
        code_version(), settings_digest(shared_settings(config)), folder_token, mark, train.fingerprint(),
        val.fingerprint(), socket.gethostname(), os.path.abspath(config.checkpoints_path), teacher))
    found = first_difference(prints)
    if found is not None:
        raise JobMismatch(describe(*found, prints, config, train, val))

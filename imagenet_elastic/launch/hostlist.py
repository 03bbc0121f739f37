"""Expand Slurm hostlist expressions (SLURM_JOB_NODELIST) such as ``gpu-a[01-03,07],gpu-b9``: parsed here because
``scontrol show hostnames`` is often missing inside containers."""

from __future__ import annotations

import itertools
import math
import re

from imagenet_elastic.errors import UserError

MAX_HOSTS = 100_000

_BOUND = re.compile(r"[0-9]+")


def _fail(text: str, problem: str) -> UserError:
    return UserError(f"bad Slurm hostlist {text!r}: {problem}")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, checking that brackets are balanced and not nested."""
    inside = False
    for i, char in enumerate(text):
        if char == "[":
            if inside:
                raise _fail(text, f"nested '[' at position {i}")
            inside = True
        elif char == "]":
            if not inside:
                raise _fail(text, f"']' without a matching '[' at position {i}")
            inside = False
    if inside:
        raise _fail(text, "'[' is never closed")
    return re.split(r",(?![^\[]*\])", text)  # a comma inside brackets has a ']' ahead before any '['


def _expand_range(text: str, body: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. ``01-03,07``, into zero-padded numbers."""
    if not body.strip():
        raise _fail(text, "empty brackets '[]'")
    numbers: list[str] = []
    for part in body.split(","):
        part = part.strip()
        if not part:
            raise _fail(text, f"empty entry in '[{body}]'")
        low, dash, high = part.partition("-")
        low, high = low.strip(), (high.strip() if dash else low.strip())
        if not _BOUND.fullmatch(low) or not _BOUND.fullmatch(high):
            raise _fail(text, f"range '{part}' in '[{body}]' needs non-negative integer bounds")
        start, end = int(low), int(high)
        if end < start:
            raise _fail(text, f"range '{part}' ends below its start")
        if len(numbers) + end - start + 1 > MAX_HOSTS:
            raise _fail(text, f"expands to more than {MAX_HOSTS} hosts")
        numbers.extend(str(n).zfill(len(low)) for n in range(start, end + 1))
    return numbers


def expand_hostlist(text: str) -> list[str]:
    """Hosts named by a Slurm hostlist expression, in Slurm's order, duplicates kept."""
    if not text or not text.strip():
        raise _fail(text, "it is empty")
    hosts: list[str] = []
    for item in (item.strip() for item in _split_top_level(text)):
        if not item:
            raise _fail(text, "empty item (two commas in a row, or a leading or trailing comma)")
        if any(char.isspace() for char in item):
            raise _fail(text, f"whitespace inside host name {item!r}")
        chunks = re.split(r"\[([^\]]*)\]", item)  # text, group, text, ...
        pieces = [_expand_range(text, chunk) if i % 2 else [chunk] for i, chunk in enumerate(chunks) if i % 2 or chunk]
        if len(hosts) + math.prod(len(piece) for piece in pieces) > MAX_HOSTS:
            raise _fail(text, f"expands to more than {MAX_HOSTS} hosts")
        hosts += ["".join(parts) for parts in itertools.product(*pieces)]
    return hosts


def first_host(text: str) -> str:
    """First host of a Slurm hostlist expression (the usual rendezvous / master node)."""
    return expand_hostlist(text)[0]

"""Errors a user can fix: printed as one line, never as a traceback."""

import sys
from typing import Optional

PROG = "imagenet-elastic"  # every error line starts "imagenet-elastic: error: "
USER_ERROR_EXIT = 2
STORAGE_ERROR_EXIT = 74  # EX_IOERR: a checkpoint could not be written (no space, I/O error, quota)
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped by a preemption signal (with a checkpoint, or before training began)
INTERRUPTED_EXIT = 130  # Ctrl-C (128 + SIGINT), with a checkpoint at the step (the first) or at once (the second)


class UserError(Exception):
    """Bad input (flag, file, variable). The message names the culprit. Most are met alike by every rank, so rank 0
    alone reports them; `every_rank` errors are one rank's own; `every_node` ones are said by each node's first rank."""

    every_rank = False
    every_node = False
    exit_code = USER_ERROR_EXIT
    # a stop signal received while ending with this error: the launcher stopping it once rank 0 had reported
    stopped_by: Optional[str] = None


class StorageError(UserError):
    """The OS refused a write (no space, I/O error, quota): as much the user's to fix, with its own exit code."""

    exit_code = STORAGE_ERROR_EXIT


class CorruptImageError(UserError):
    """An image file that cannot be decoded; raised inside DataLoader workers."""

    every_rank = True


# Pillow's own words for a file it cannot identify name its buffer (`<_io.BytesIO object at ..>`), not the file
UNIDENTIFIED_IMAGE = "not an image of a format Pillow reads (JPEG, PNG, ...)"


class RendezvousError(UserError):
    """Peers or the rendezvous store did not show up within --dist-timeout."""

    every_rank = True


class FailedOnRank0(UserError):
    """What rank 0 alone did failed: every rank raises this, with rank 0's line and exit code (rank_0_does)."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.exit_code = exit_code


class Preempted(Exception):
    """Every rank stops at the same step boundary after a preemption signal or Ctrl-C; the checkpoint is safe."""

    def __init__(self, exit_code: int = PREEMPTED_EXIT) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


def one_line(error: BaseException) -> str:
    """The user-facing line of an error, also when a DataLoader worker re-raised it: its message then embeds the
    worker's traceback, whose last line is "ClassName: message" (ClassName module-qualified if not a builtin)."""
    text = str(error).strip()
    if "Traceback" in text:
        last = text.splitlines()[-1]
        name = type(error).__name__
        head, sep, rest = last.partition(": ")
        text = rest if sep and (head == name or head.endswith(f".{name}")) else last
    return " ".join(text.split())


def first_line(error: BaseException) -> str:
    """An error's first non-empty line, or its class name when it has no message."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(error).__name__


def counted(number: int, noun: str, plural: Optional[str] = None) -> str:
    """`1 parquet file`, `2 parquet files` (`plural` where it is not the noun and an s)."""
    return f"{number} {noun}" if number == 1 else f"{number} {plural or noun + 's'}"


def report(error: UserError, rank: int, own: bool = False) -> None:
    """Rank 0 reports for all; other ranks only errors that are theirs alone (`every_rank`, or `own`)."""
    if rank == 0 or error.every_rank or own:
        print(f"{PROG}: error: {f'[rank {rank}] ' if rank else ''}{one_line(error)}", file=sys.stderr, flush=True)

"""The one place that prints: rank 0 only, a rich table and progress bar on a terminal, plain lines in logs;
warnings on stderr, so `2>warnings.log` keeps them apart from progress."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class Console:
    def __init__(self, enabled: bool, rank: int = 0) -> None:
        self.enabled, self.rank = enabled, rank
        # a bar and colours only on a real terminal, whatever FORCE_COLOR or TTY_COMPATIBLE say (rich believes them)
        self.rich = RichConsole(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120,
                                force_terminal=sys.stdout.isatty())
        self.errors = RichConsole(stderr=True, highlight=False, soft_wrap=True, force_terminal=sys.stderr.isatty())

    def info(self, message: str) -> None:
        if self.enabled:
            self.rich.print(message, markup=False)
            self.rich.file.flush()  # log files under Slurm or torchrun see progress as it happens

    def warn(self, message: str, every_rank: bool = False) -> None:
        """`every_rank`: for what only this rank can know (a file its own loader met), said with its rank."""
        if every_rank or self.enabled:
            who = f"rank {self.rank}: " if every_rank else ""
            self.errors.print(f"warning: {who}{message}", markup=False, style="yellow")
            self.errors.file.flush()

    def table(self, title: str, rows: list[tuple[str, str]]) -> None:
        if not self.enabled:
            return
        if not self.rich.is_terminal:  # logs: one unwrapped line per row, so `grep` finds every value whole
            width = max(len(key) for key, _ in rows)
            self.info("\n".join([title, *(f"  {key:<{width}}  {value}" for key, value in rows)]))
            return
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value)
        self.rich.print(table)

    def result(self, obj: dict[str, Any]) -> None:
        """A machine-readable line on stdout (e.g. --evaluate's last line)."""
        if self.enabled:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    @contextmanager
    def progress(self, description: str, total: int, done: int = 0) -> Iterator[EpochProgress]:
        """`done`: steps of the epoch finished before a resume."""
        if not (self.enabled and self.rich.is_terminal):
            yield EpochProgress(self, description, total)
            return
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=self.rich,
                      transient=False) as bar:
            yield EpochProgress(self, description, total, bar,
                                bar.add_task(description, total=total, completed=done, stats=""))


class EpochProgress:
    """Per-step updates: a live bar on a terminal, else a line for each update with stats (every --log-interval)."""

    def __init__(self, console: Console, description: str, total: int, bar: Optional[Progress] = None,
                 task: Any = None) -> None:
        self.console, self.description, self.total, self.bar, self.task = console, description, total, bar, task

    def update(self, step: int, stats: str = "") -> None:
        if not self.console.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=step, **({"stats": stats} if stats else {}))
        elif stats:
            self.console.info(f"{self.description} step {step}/{self.total} {stats}")


def clock(seconds: float) -> str:
    """`1:02:03`, `12:34`, or `2d 03:04:05` for an ETA."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

"""How a setting is declared, by the folder that owns it: `option(default, help, group, ...)` makes a dataclass field
that carries its flag's help, metavar and argparse keywords; the value types here check their range. Also the
argparse pieces every command line uses: one-line errors, and help that shows defaults only where they add something."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Callable, NoReturn, Optional

# the groups of the trainer's --help and of docs/OPTIONS.md's table
GROUPS = {"model": "model and optimisation", "augment": "training augmentation", "run": "run",
          "checkpoints": "checkpoints", "distributed": "distributed"}


def option(default: Any, help: str, group: str, metavar: Any = None, shown_default: Optional[str] = None,
           exact: bool = False, **argparse_options: Any) -> Any:
    """A setting's field: its default, argparse keywords, and the default as docs/OPTIONS.md shows it if need be.
    `exact`: a changed value between a checkpoint and its resumed run breaks exact continuation (a warning says so:
    config.RESUME_SENSITIVE). A typed setting whose default is None also takes `none`, so that the command line can
    unset a value a recipe or --config file gave."""
    assert group in GROUPS, group
    if default is None and "type" in argparse_options:
        argparse_options["type"] = or_none(argparse_options["type"])
    return field(default=default, metadata={"help": help, "group": group, "metavar": metavar,
                                            "shown_default": shown_default, "exact": exact,
                                            "argparse": argparse_options})


def or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, but `none` is None (the unset default), as --preempt-signals none is no signal."""
    return lambda text: None if text.strip().lower() == "none" else parse(text)


class Parser(argparse.ArgumentParser):
    source: Optional[str] = None  # a config file whose values this parser reads: errors name it

    def error(self, message: str) -> NoReturn:
        """One line, no usage dump: `imagenet-elastic: error: argument --batch-size: ...`."""
        where = f"config file {self.source}: " if self.source else ""
        self.exit(2, f"{self.prog}: error: {where}{message} (see --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every default as a user would type it, unless the help says it or there is none; descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} (default: {shown(default)})"


def shown(value: object) -> str:
    """A default as the command line writes it."""
    if value is True:
        return "on"
    if isinstance(value, (tuple, list)):  # names as one comma-separated word (signals); numbers as nargs
        if not value:
            return "none"
        return ("," if all(isinstance(v, str) for v in value) else " ").join(shown(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def described(registry: Mapping[str, Any]) -> str:
    """A registry's names with each entry's `help`, for the option that chooses among them: `a (help), b (help)`."""
    return ", ".join(f"{name} ({entry.help})" for name, entry in registry.items())


def bounded(kind: type, low: float, high: Optional[float] = None, inclusive: bool = True) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if kind is float and not math.isfinite(value):  # nan would pass every comparison below
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (not inclusive and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value
    return parse


positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
non_negative_float = bounded(float, 0.0)
positive_float = bounded(float, 0.0, inclusive=False)
port_number = bounded(int, 1, 65535)
# seconds a rank waits for its peers: torch's timeouts overflow (or wrap to none at all) far above a week
timeout_seconds = bounded(float, 0.0, 7 * 24 * 3600.0, inclusive=False)
probability = bounded(float, 0.0, 1.0)
# Bounds far beyond any real use: a larger value would end in an overflow or out-of-memory traceback, not one line
seed_number = bounded(int, 0, 2**64 - 1)  # torch.manual_seed takes 64 bits
MAX_SIDE = 4096  # px of a crop or resize: the largest ImageNet models test at 800
image_side = bounded(int, 1, MAX_SIDE)
worker_count = bounded(int, 0, 128)  # DataLoader processes per rank, each a copy of the process (the default: <= 8)
per_node_count = bounded(int, 1, 1024)  # threads per rank, processes per node: more than any node's cores
MAX_EPOCHS = 100_000  # start-up goes over every epoch's sizes; recipes train <= 1600 epochs
epoch_count = bounded(int, 1, MAX_EPOCHS)
batch_count = bounded(int, 1, 2**20)  # images in a batch: a million 32 px crops fill 12 GB before the model runs
step_count = bounded(int, 1, 10**9)  # steps between two things (log lines, EMA updates): no run takes 10**9 steps
repeat_count = bounded(int, 1, 64)  # copies of each image in a batch (--ra-reps): DeiT's recipes use 3
kept_count = bounded(int, 0, 10**6)  # files kept: a million checkpoints fill any disk
jpeg_side = bounded(int, 1, 65535)  # px of a stored image's side: JPEG's largest

_UNITS = {"s": 1, "m": 60, "h": 3600}


def checkpoint_interval(text: str) -> tuple[Optional[int], Optional[float]]:
    """`500` (steps), `10m` / `90s` / `2h` (time), or both: `500,10m` -> (500, 600.0); not two of a kind (`1m,2m`),
    of which one would be dropped unsaid; `none` -> (None, None), the default: no mid-epoch checkpoints."""
    steps: Optional[int] = None
    seconds: Optional[float] = None
    if text.strip().lower() == "none":
        return steps, seconds
    try:
        for item in (part.strip().lower() for part in text.split(",")):
            timed = bool(item) and item[-1] in _UNITS
            if (seconds if timed else steps) is not None:
                raise argparse.ArgumentTypeError(f"expected one step count and one time at most, got {text!r}")
            if timed:
                seconds = float(item[:-1]) * _UNITS[item[-1]]
            else:
                steps = int(item)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected steps (500), a time (10m, 90s, 2h) or both (500,10m), got {text!r}") from None
    if seconds is not None and not math.isfinite(seconds):
        raise argparse.ArgumentTypeError(f"must be a finite time, got {text!r}")
    if (steps is not None and steps <= 0) or (seconds is not None and seconds <= 0):
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return steps, seconds


def increasing_pair(text: str, least: int, most: int) -> tuple[int, int]:
    """`160,192` -> (160, 192): two integers, the first below the second, within `least`..`most`."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers LOW,HIGH, got {text!r}") from None
    if not least <= low < high:
        raise argparse.ArgumentTypeError(f"must be increasing ({least} <= LOW < HIGH), got {text!r}")
    if high > most:
        raise argparse.ArgumentTypeError(f"HIGH must be <= {most}, got {text!r}")
    return low, high


side_pair = functools.partial(increasing_pair, least=1, most=MAX_SIDE)  # image_side's bounds
epoch_pair = functools.partial(increasing_pair, least=0, most=MAX_EPOCHS)  # up to --epochs' bound


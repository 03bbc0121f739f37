"""`imagenet-elastic plot CHECKPOINTS_DIR`: a run's curves in one picture (PNG by default).

Reads CHECKPOINTS_DIR/metrics.jsonl (one row per completed epoch) and, when there is one,
CHECKPOINTS_DIR/steps.jsonl (a row per log interval), and draws three panels on one epoch axis:

1. loss: train and validation per epoch (and the EMA model's validation loss when there is one),
   over the per-step training loss as a thin line when steps.jsonl is there;
2. validation accuracy: top-1, top-5 dashed, and the EMA model's top-1 when there is one;
3. learning rate: per step from steps.jsonl, else the rate at the end of each epoch.

Vertical lines mark where the world size changed (labelled "world 2 -> 4") and where a run resumed
from a checkpoint. A row's epoch number N covers the fractional epochs N-1 to N of steps.jsonl; its
points are drawn at N, and its marks at N-1, the start of the epoch in which the change happened
(a resume may have come back in the middle of it: the files do not say where).

matplotlib is an optional extra: pip install "imagenet_elastic[plot]".
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from imagenet_elastic.errors import UserError, report
from imagenet_elastic.options import HelpFormatter, Parser
from imagenet_elastic.report import metrics
from imagenet_elastic.report.metrics import is_number
from imagenet_elastic.report.sinks import steps_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_OUTPUT = "curves.png"
INSTALL = 'pip install "imagenet_elastic[plot]"'
FORMATS = ("png", "pdf", "svg")

WORLD, RESUME = "world", "resume"
MARK_STYLES = {  # one style per kind of mark, the same in every panel and in the legend
    WORLD: {"color": "tab:purple", "linestyle": "-", "linewidth": 4.0, "alpha": 0.35},  # wide, under a resume's
    RESUME: {"color": "tab:red", "linestyle": ":", "linewidth": 1.4, "alpha": 0.9},
}
MARK_LEGEND = {WORLD: "world size changed", RESUME: "resumed from a checkpoint"}
# (metrics key, label, style) of the epoch curves of the loss and accuracy panels
LOSS_CURVES = (("train_loss", "train loss", {"color": "tab:blue"}), ("val_loss", "val loss", {"color": "tab:orange"}),
               ("val_loss_ema", "val loss (EMA)", {"color": "tab:green", "linestyle": "--"}))
ACCURACY_CURVES = (("val_top1", "top-1", {"color": "tab:orange"}),
                   ("val_top5", "top-5", {"color": "tab:orange", "linestyle": "--", "alpha": 0.7}),
                   ("val_top1_ema", "top-1 (EMA)", {"color": "tab:green"}))


class Event(NamedTuple):
    epoch: int  # the metrics row's epoch number: the change happened during it
    kind: str  # WORLD or RESUME
    label: str


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic plot", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("checkpoints_dir", metavar="CHECKPOINTS_DIR",
                   help="the run's --checkpoints-path: the folder with metrics.jsonl (and steps.jsonl)")
    p.add_argument("-o", "--output", metavar="PATH", default=None,
                   help=f"the picture to write (.png, .pdf or .svg); default: CHECKPOINTS_DIR/{DEFAULT_OUTPUT}")
    return p


def read_metrics(folder: str) -> list[dict[str, Any]]:
    """The epoch rows, or a UserError that says what is missing."""
    if not os.path.exists(folder):
        raise UserError(f"{folder}: no such folder")
    if not os.path.isdir(folder):
        raise UserError(f"{folder}: not a folder (expected the run's --checkpoints-path)")
    path = os.path.join(folder, metrics.FILENAME)
    if not os.path.exists(path):
        raise UserError(f"no {path}: the run has not completed an epoch yet")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        # a torn last line (no newline, not a whole row: a write or a copy cut short) is left out with a warning, as a
        # resumed run rewrites the file without it; damage anywhere else stays an error
        if lines and not text.endswith("\n") and not any(steps_file.whole_rows(lines[-1])):
            print(f"warning: {path}: its last line is torn (cut short); plotting the rows before it", file=sys.stderr,
                  flush=True)
            lines.pop()
        rows = [json.loads(line) for line in lines if line.strip()]
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{path} is not JSON lines: {error}") from None
    if not rows:
        raise UserError(f"{path} is empty: the run has not completed an epoch yet")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not is_number(row.get("epoch")):
            raise UserError(f"{path} line {number}: expected an object with an epoch number, got {row!r:.80}")
    return rows


def read_steps(folder: str) -> list[dict[str, Any]]:
    """The per-step rows the plot can use; none when the file is absent or unreadable; torn lines are skipped."""
    path = os.path.join(folder, steps_file.FILENAME)
    try:
        text = steps_file.read_text(path)
    except OSError:
        return []
    used = ("epoch", "loss", "lr")
    return [row for _, row in steps_file.whole_rows(text) if all(is_number(row.get(key)) for key in used)]


def events(rows: Sequence[dict[str, Any]]) -> list[Event]:
    """World-size changes and resumes in epoch order, a world-size change before the resume that usually brought it."""
    found, previous = [], None
    for row in rows:
        world = row.get("world_size")
        if world is not None:
            if previous is not None and world != previous:
                found.append(Event(row["epoch"], WORLD, f"world {previous} -> {world}"))
            previous = world
        if row.get("resumed") is True:
            found.append(Event(row["epoch"], RESUME, "resumed"))
    return found


def figure(rows: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]] = (), title: str = "") -> Figure:
    """The three panels as a matplotlib Figure (not attached to pyplot: nothing to close, no display)."""
    try:  # matplotlib first: where matplotlib.figure is imported already, only its import raises
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # draws with Agg without pyplot or a backend switch
        from matplotlib.lines import Line2D
    except ImportError:
        raise UserError(f"plot needs matplotlib, which is not installed: {INSTALL}") from None

    fig = Figure(figsize=(10, 11), dpi=100, layout="constrained")
    loss_ax, acc_ax, lr_ax = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [4, 4, 2.5]})
    epochs = [row["epoch"] for row in rows]
    marker = {"marker": "o", "markersize": 3.5} if len(rows) <= 60 else {}

    def column(key: str) -> Optional[list[float]]:
        """A row key as a curve (missing values as gaps), or None when no row has a number for it."""
        values = [row.get(key) for row in rows]
        if not any(is_number(v) and math.isfinite(v) for v in values):
            return None
        return [float(v) if is_number(v) else math.nan for v in values]

    if steps:
        step_epochs = [s["epoch"] for s in steps]
        loss_ax.plot(step_epochs, [s["loss"] for s in steps], color="tab:blue", linewidth=0.5,
                     alpha=0.35 if len(steps) < 5000 else 0.25, label="train loss (per step)", zorder=1)
        lr_ax.plot(step_epochs, [s["lr"] for s in steps], color="tab:gray", linewidth=1.2, label="per step")
    elif (values := column("lr")) is not None:
        lr_ax.plot(epochs, values, color="tab:gray", linewidth=1.2, label="end of epoch", **marker)
    for ax, curves in ((loss_ax, LOSS_CURVES), (acc_ax, ACCURACY_CURVES)):
        for key, label, style in curves:
            if (values := column(key)) is not None:
                ax.plot(epochs, values, label=label, linewidth=1.8, zorder=3, **style, **marker)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    lr_ax.set_xlabel("epoch")
    lr_ax.set_xlim(left=0)

    marks = events(rows)
    mark_handles = [Line2D([], [], label=MARK_LEGEND[kind], **MARK_STYLES[kind])
                    for kind in (WORLD, RESUME) if any(event.kind == kind for event in marks)]
    # legends where the curves usually are not: loss falls, accuracy rises, the rate decays
    for ax, name, loc, extra in ((loss_ax, "loss", "upper right", mark_handles),
                                 (acc_ax, "validation accuracy (%)", "lower right", []),
                                 (lr_ax, "learning rate", "upper right", [])):
        ax.set_ylabel(name)
        for event in marks:
            ax.axvline(event.epoch - 1, zorder=2, **MARK_STYLES[event.kind])
        ax.grid(True, alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles or extra:
            ax.legend(handles=handles + extra, loc=loc, fontsize=9, framealpha=0.85)
    label_marks(loss_ax, marks)
    if title:
        fig.suptitle(title, fontsize=12)
    return fig


def label_marks(ax: Any, marks: Sequence[Event]) -> None:
    """World-size changes get a slanted label above the top panel; changes closer than 3% of the axis share one
    label ("world 8 -> 16 -> 8 -> 4"). Resumes, more frequent, are told by their line style alone."""
    low, high = ax.get_xlim()
    groups: list[list[Event]] = []
    for event in (event for event in marks if event.kind == WORLD):
        if groups and event.epoch - groups[-1][-1].epoch <= 0.03 * (high - low):
            groups[-1].append(event)
        else:
            groups.append([event])
    for group in groups:
        text = group[0].label + "".join(" -> " + event.label.rsplit(" -> ", 1)[-1] for event in group[1:])
        ax.annotate(text, xy=(group[0].epoch - 1, 1.0), xycoords=("data", "axes fraction"), xytext=(-2, 3),
                    textcoords="offset points", rotation=30, ha="left", va="bottom", fontsize=8.5,
                    color=MARK_STYLES[WORLD]["color"])


def title_of(folder: str, rows: Sequence[dict[str, Any]]) -> str:
    """`run: 12 epochs, world size 4 at the end, best top-1 74.50% (epoch 12), EMA 76.42% (epoch 12)`."""
    parts = [f"{os.path.basename(os.path.abspath(folder))}: {len(rows)} epoch{'' if len(rows) == 1 else 's'}"]
    if is_number(rows[-1].get("world_size")):
        parts.append(f"world size {rows[-1]['world_size']} at the end")
    for key, name in (("val_top1", "best top-1"), ("val_top1_ema", "EMA")):  # the highest finite value
        scored = [(row["epoch"], float(row[key])) for row in rows
                  if is_number(row.get(key)) and math.isfinite(row[key])]
        if scored:
            epoch, value = max(scored, key=lambda item: item[1])
            parts.append(f"{name} {value:.2f}% (epoch {epoch})")
    return ", ".join(parts)


def plot(folder: str, output: Optional[str] = None) -> str:
    """Write the picture of the run in `folder`; returns its path."""
    rows = read_metrics(folder)
    output = output or os.path.join(folder, DEFAULT_OUTPUT)
    extension = os.path.splitext(output)[1].lower().lstrip(".")
    if extension not in FORMATS:
        raise UserError(f"-o {output}: the picture must end in " + ", ".join(f".{ext}" for ext in FORMATS))
    fig = figure(rows, read_steps(folder), title_of(folder, rows))
    try:
        fig.savefig(output, format=extension)
    except OSError as error:
        raise UserError(f"cannot write {output}: {error.strerror or error}") from None
    return output


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    try:
        path = plot(args.checkpoints_dir, args.output)
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)
    print(path)

"""A run's rows, built here and nowhere else: a step row at each log interval (steps.jsonl), an epoch row at each
epoch's end (metrics.jsonl), and the scalars every sink (report/sinks) makes of them. A new metric is a line in
`step_row` or `epoch_row`: every sink gets it. metrics.jsonl is never duplicated across resumes."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Protocol

from imagenet_elastic.atomic_files import store_bytes

FILENAME = "metrics.jsonl"
TRAIN, EPOCH = "train", "epoch"  # the scalars' prefixes: `train/loss` of a step row, `epoch/val_top1` of an epoch's


class Tally(Protocol):
    """What training did over some steps, all ranks together."""

    samples: int
    steps: int
    loss_sum: float  # sum over steps of the step's mean loss over all ranks
    seconds: float
    parts: dict[str, float]  # the same sums of the loss's named parts (--teacher: task_loss, distill_loss)


def step_row(step: int, epoch: float, since: Tally, lr: float, waited: float) -> dict[str, Any]:
    """steps.jsonl's row for the steps `since` the last one, up to optimizer step `step` at fractional `epoch`;
    `waited`: seconds of those steps spent waiting for the loader."""
    seconds = max(since.seconds, 1e-9)
    return {
        "step": step,
        "epoch": round(epoch, 4),
        "loss": since.loss_sum / since.steps,  # the mean over these steps and all ranks
        **{name: value / since.steps for name, value in since.parts.items()},
        "lr": lr,
        "images_per_sec": since.samples / seconds,
        "data_wait": min(1.0, waited / seconds),  # the share of the time the loop waited for its next batch
    }


def epoch_row(*, epoch: int, step: int, tally: Tally, validated: dict[str, Any], lr: float, train_size: int,
              world_size: int, global_batch: int, seconds: float, resumed: bool) -> dict[str, Any]:
    """metrics.jsonl's row of a completed epoch; `resumed` marks one a process resumed from a checkpoint finished."""
    return {
        "epoch": epoch,
        "step": step,  # the optimizer step that ended it: where TensorBoard and the trackers put the row
        "train_loss": tally.loss_sum / tally.steps if tally.steps else float("nan"),
        **{f"train_{name}": value / tally.steps for name, value in tally.parts.items() if tally.steps},
        **validated,
        "lr": lr,
        "images_per_sec": tally.samples / tally.seconds if tally.seconds else 0.0,
        "train_size": train_size,
        "world_size": world_size,
        "global_batch": global_batch,
        "epoch_seconds": seconds,
        **({"resumed": True} if resumed else {}),
    }


def is_number(value: Any) -> bool:
    """Whether a row's value is a scalar for the sinks and the plot: JSON's numbers, and true/false as 1 and 0 (the
    `resumed` mark becomes a point at 1); never a string or null."""
    return isinstance(value, (int, float))


def scalars(kind: str, row: dict[str, Any]) -> dict[str, float]:
    """A row as every sink but the JSON files gets it: each number under `kind/KEY`; `step` is the x axis."""
    return {f"{kind}/{key}": float(value) for key, value in row.items() if key != "step" and is_number(value)}


def json_line(row: dict[str, Any]) -> str:
    """A row as a line of strict JSON: a number that is not finite (a diverged loss) is null, which every JSON
    reader takes (json.dumps' bare NaN and Infinity are not JSON: jq, pandas and strict parsers refuse the file)."""
    finite = {key: None if isinstance(value, float) and not math.isfinite(value) else value
              for key, value in row.items()}
    return json.dumps(finite, allow_nan=False) + "\n"


def write(folder: str, history: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl from the checkpointed history (atomic; a few hundred bytes per epoch), so a run killed
    between the two writes, or resumed from an older checkpoint, never repeats or loses an epoch's row."""
    store_bytes("".join(map(json_line, history)).encode(), os.path.join(folder, FILENAME))


def read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

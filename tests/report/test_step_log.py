"""Curves (report/sinks: steps.jsonl, TensorBoard) and what the progress line says: rows trimmed to the checkpoint
on restart, TensorBoard continuing without duplicated or out-of-order steps (read back from the event files),
ETAs, the best epoch, and plain lines in log files whatever FORCE_COLOR says. The same continuity
through a real SIGKILL and resume is in test_training.py; every sink getting every number, in test_sinks.py."""

from __future__ import annotations

import importlib.util
import json

import inprocess
import pytest
from conftest import SMALL_RUN, assert_names
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imagenet_elastic import cli
from imagenet_elastic.errors import UserError
from imagenet_elastic.report.console import Console, clock
from imagenet_elastic.report.sinks import Sinks, chosen, tensorboard_wanted
from imagenet_elastic.report.sinks.steps_file import FILENAME, StepsFile, kept_rows, trim
from imagenet_elastic.report.sinks.tensorboard_events import FOLDER as TENSORBOARD_DIR
from imagenet_elastic.report.sinks.tensorboard_events import TensorBoard
from imagenet_elastic.tools import plot
from imagenet_elastic.train.trainer import Trainer, best_epoch


def row(step: int, loss: float) -> dict:
    return {"step": step, "epoch": step / 10, "loss": loss, "lr": 0.1, "images_per_sec": 50.0, "data_wait": 0.25}


def test_rows_beyond_the_checkpoint_and_a_torn_last_line_are_dropped():
    text = "".join(json.dumps(row(s, 1.0)) + "\n" for s in (2, 4, 6, 8)) + '{"step": 10, "lo'
    assert [json.loads(line)["step"] for line in kept_rows(text, 6)] == [2, 4, 6]
    assert kept_rows(text, 0) == []


def test_bytes_that_are_not_utf8_in_steps_jsonl_cost_their_line_alone_at_resume(tmp_path):
    """A damaged byte made the resumed run's trim raise UnicodeDecodeError (a traceback); metrics.jsonl is rewritten
    from the checkpoint anyway. Each line stays as any damaged line is: kept if it is still a row, else dropped."""
    lines = [json.dumps(row(s, 1.0)).encode() for s in (2, 4, 6, 8)]
    lines[1] = lines[1].replace(b'"loss"', b'"lo\xffss"')  # still a row
    lines[2] = lines[2].replace(b'"lr": 0.1', b'"lr": 0.\xfe1')  # no longer one
    (tmp_path / FILENAME).write_bytes(b"\n".join(lines) + b"\n")
    warned: list[str] = []
    assert [r["step"] for r in trim(str(tmp_path), 6, warned.append)] == [2, 4]
    assert [json.loads(line)["step"] for line in (tmp_path / FILENAME).read_text().splitlines()] == [2, 4]
    assert len(warned) == 1
    assert_names(warned[0], tmp_path / FILENAME, "line", "3")


def test_a_damaged_line_inside_steps_jsonl_is_warned_of_with_its_number_and_a_torn_last_line_is_not(tmp_path):
    rows = [json.dumps(row(s, 1.0)) for s in (2, 4, 6, 8)]
    (tmp_path / FILENAME).write_text("\n".join([rows[0], '{"step": 3, "lo', rows[1], "", rows[2], '{"step": 7,']))
    warned: list[str] = []
    assert [r["step"] for r in trim(str(tmp_path), 6, warned.append)] == [2, 4, 6]
    assert len(warned) == 1
    assert_names(warned[0], tmp_path / FILENAME, "line", "2")
    assert "6" not in warned[0].replace(str(tmp_path), "")  # the torn last line: dropped unsaid
    (tmp_path / FILENAME).write_text("\n".join(rows) + "\n" + '{"step": 10')
    assert [r["step"] for r in trim(str(tmp_path), 8, warned.append)] == [2, 4, 6, 8] and len(warned) == 1


def started(folder, start_step: int, tensorboard: bool = True) -> Sinks:
    """Rank 0's steps.jsonl (and TensorBoard), started as a run from the checkpoint at `start_step` starts them."""
    sinks = Sinks([StepsFile(str(folder)), *([TensorBoard(str(folder))] if tensorboard else [])], str(folder), print)
    sinks.start(start_step, [], {}, continuing=True, started_from=None, name="run", settings={}, facts={})
    return sinks


def log_steps(folder, start_step: int, steps, loss: float, tensorboard: bool = True) -> None:
    sinks = started(folder, start_step, tensorboard)
    for s in steps:
        sinks.step(row(s, loss + s))
    sinks.epoch({"step": steps[-1], "train_loss": 0.5, "images_per_sec": 40.0, "val_loss": 0.7, "val_top1": 60.0,
                 "val_samples": 35})
    sinks.close(finished=False)


def test_a_restart_from_an_earlier_checkpoint_continues_both_curves_without_repeats(tmp_path):
    log_steps(tmp_path, 0, list(range(1, 11)), loss=0.0)  # killed after step 10, its checkpoint is at step 6
    log_steps(tmp_path, 6, list(range(7, 13)), loss=100.0)  # the resumed run trains 7.. again
    rows = [json.loads(line) for line in (tmp_path / FILENAME).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["loss"] for r in rows] == [float(s) for s in range(1, 7)] + [100.0 + s for s in range(7, 13)]
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 13))
    assert [e.value for e in loss] == [float(s) for s in range(1, 7)] + [100.0 + s for s in range(7, 13)]
    assert {"train/lr", "train/images_per_sec", "train/data_wait", "epoch/train_loss", "epoch/val_loss",
            "epoch/val_top1"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("epoch/val_top1")] == [12]  # the first run's epoch (step 10) was purged


def test_a_run_that_logs_nothing_leaves_no_file(tmp_path):
    """A run that fails at its first batch (a corrupt image) changes nothing on disk."""
    sinks = started(tmp_path, 0)
    sinks.flush()
    sinks.close(finished=False)
    assert list(tmp_path.iterdir()) == []


def test_only_rank_0_writes(tmp_path):
    config, _ = cli.parse([str(tmp_path), "--checkpoints-path", str(tmp_path), "--tensorboard"])
    assert chosen(config, is_main=False) == []
    assert [type(sink) for sink in chosen(config, is_main=True)] == [StepsFile, TensorBoard]
    sinks = Sinks(chosen(config, is_main=False), str(tmp_path), print)
    sinks.start(0, [], {}, continuing=False, started_from=None, name="run", settings={}, facts={})
    sinks.step(row(1, 1.0))
    sinks.close(finished=True)
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_when_installed_unless_refused_and_a_clear_error_when_asked_for_but_missing(monkeypatch):
    assert tensorboard_wanted(None) is True and tensorboard_wanted(False) is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert tensorboard_wanted(None) is False
    with pytest.raises(UserError, match=r'--tensorboard needs the tensorboard package: pip install '
                                        r'"imagenet_elastic\[tensorboard\]"'):
        tensorboard_wanted(True)


@pytest.mark.parametrize("seconds, shown", [(0, "0:00"), (59.6, "1:00"), (754, "12:34"), (3723, "1:02:03"),
                                            (2 * 86400 + 3 * 3600 + 4 * 60 + 5, "2d 03:04:05"), (-3, "0:00")])
def test_eta_clock(seconds, shown):
    assert clock(seconds) == shown


def test_the_best_epoch_is_the_one_fit_saves_as_best_pt_with_the_weights_that_scored_it():
    history = [{"epoch": 1, "val_top1": 50.0}, {"epoch": 2, "val_top1": 61.0, "val_top1_ema": 60.0},
               {"epoch": 3, "val_top1": 58.0, "val_top1_ema": 62.5}, {"epoch": 4, "val_top1": 62.5}]
    best, ema = best_epoch(history)
    assert best["epoch"] == 3 and ema  # epoch 4 only ties it
    assert best_epoch([]) is None


def test_a_log_file_gets_plain_lines_whatever_force_color_and_tty_compatible_say(monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    console = Console(enabled=True)
    with console.progress("epoch 1/1", total=4) as progress:
        for step in range(1, 5):
            progress.update(step, f"loss {step}" if step % 2 == 0 else "")
    console.warn("look here")
    out, err = capsys.readouterr()
    assert out.splitlines() == ["epoch 1/1 step 2/4 loss 2", "epoch 1/1 step 4/4 loss 4"]
    assert err == "warning: look here\n" and "\x1b[" not in out + err


def strict_json_rows(path) -> list[dict]:
    """The file's rows as a strict JSON parser (jq, pandas) reads them: a bare NaN or Infinity is refused."""
    def refused(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return [json.loads(line, parse_constant=refused) for line in path.read_text().splitlines()]


def test_non_finite_losses_are_null_in_metrics_and_steps_jsonl_and_the_plot_reads_them(image_folder, tmp_path,
                                                                                         monkeypatch):
    # non-finite losses over and over, as a run whose weights stay finite reads them (fp16's skipped steps): here
    # a huge LR's, with the stop a diverged run makes (tests/train/test_divergence.py) left out
    monkeypatch.setattr(Trainer, "stop_if_diverged", lambda self, loss: None)
    inprocess.train([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "2", "--max-steps-per-epoch", "2",
                     "--lr", "1e30", "--checkpoints-path", str(tmp_path)])
    epochs, steps = strict_json_rows(tmp_path / "metrics.jsonl"), strict_json_rows(tmp_path / "steps.jsonl")
    assert [row["epoch"] for row in epochs] == [1, 2] and epochs[-1]["train_loss"] is None
    assert epochs[-1]["val_loss"] is None and isinstance(epochs[-1]["val_top1"], float)
    assert steps[-1]["loss"] is None and isinstance(steps[-1]["lr"], float)
    assert plot.read_metrics(str(tmp_path)) == epochs
    plot.figure(epochs, plot.read_steps(str(tmp_path)))  # the diverged curves as gaps

"""`imagenet-elastic plot`: the picture of a run's metrics.jsonl and steps.jsonl, and its one-line errors."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from conftest import assert_names, single_line

from imagenet_elastic.tools import plot

EPOCHS = 12
STEPS_PER_EPOCH = 20


def lr_at(epoch: float) -> float:
    """One warmup epoch to 0.4, then cosine to zero."""
    return 0.4 * epoch if epoch < 1 else 0.2 * (1 + math.cos(math.pi * (epoch - 1) / (EPOCHS - 1)))


def metric_rows() -> list[dict]:
    """World size 2, then 4 from epoch 5 (a resume brought it), another resume at epoch 9; EMA on from epoch 3."""
    rows = []
    for epoch in range(1, EPOCHS + 1):
        world = 2 if epoch < 5 else 4
        row = {"epoch": epoch, "train_loss": 6.5 * 0.85 ** epoch + 0.8, "val_loss": 6.2 * 0.86 ** epoch + 1.0,
               "val_top1": 80 * (1 - 0.8 ** epoch), "val_top5": 95 * (1 - 0.7 ** epoch), "lr": lr_at(epoch),
               "images_per_sec": 900.0 * world, "train_size": 224, "world_size": world, "global_batch": 256,
               "epoch_seconds": 120.0}
        if epoch >= 3:
            row.update(val_loss_ema=6.2 * 0.86 ** epoch + 0.9, val_top1_ema=82 * (1 - 0.8 ** epoch),
                       val_top5_ema=96 * (1 - 0.7 ** epoch))
        if epoch in (5, 9):
            row["resumed"] = True
        rows.append(row)
    return rows


def step_rows() -> list[dict]:
    rows = []
    for step in range(1, EPOCHS * STEPS_PER_EPOCH + 1):
        epoch = step / STEPS_PER_EPOCH
        rows.append({"step": step, "epoch": round(epoch, 4), "loss": 6.5 * 0.85 ** epoch + 0.8 + 0.3 * math.sin(step),
                     "lr": lr_at(epoch), "images_per_sec": 1800.0, "data_wait": 0.05})
    return rows


def write_jsonl(path, rows: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    write_jsonl(folder / "metrics.jsonl", metric_rows())
    write_jsonl(folder / "steps.jsonl", step_rows(), tail='{"step": 241, "epoch": 12.0')  # a torn last line
    return folder


def error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        plot.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("imagenet-elastic: error: "), captured.err
    return lines[0]


# ----------------------------------------------------------------------------- marks

def test_events_mark_world_size_changes_and_resumes():
    assert plot.events(metric_rows()) == [(5, "world", "world 2 -> 4"), (5, "resume", "resumed"),
                                          (9, "resume", "resumed")]


def test_events_of_old_files_without_resumed_or_world_size():
    rows = [{"epoch": 1, "world_size": 8}, {"epoch": 2}, {"epoch": 3, "world_size": 8},
            {"epoch": 4, "world_size": 2, "resumed": False}]
    assert plot.events(rows) == [(4, "world", "world 8 -> 2")]
    assert plot.events([{"epoch": 1, "resumed": True}]) == [(1, "resume", "resumed")]


# ----------------------------------------------------------------------------- the figure's content

def line_labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_figure_has_the_three_panels_with_steps_ema_and_marks():
    rows, steps = metric_rows(), step_rows()
    fig = plot.figure(rows, steps, title="run: 12 epochs")
    loss_ax, acc_ax, lr_ax = fig.axes
    assert fig.get_suptitle() == "run: 12 epochs"
    assert line_labels(loss_ax) == ["train loss (per step)", "train loss", "val loss", "val loss (EMA)"]
    assert line_labels(acc_ax) == ["top-1", "top-5", "top-1 (EMA)"]
    assert line_labels(lr_ax) == ["per step"]
    assert lr_ax.get_xlabel() == "epoch" and "learning rate" in lr_ax.get_ylabel()

    per_step = loss_ax.get_lines()[0]
    assert len(per_step.get_xdata()) == len(steps) and per_step.get_linewidth() < 1
    top5 = acc_ax.get_lines()[1]
    assert top5.get_linestyle() == "--"
    ema = [line for line in acc_ax.get_lines() if line.get_label() == "top-1 (EMA)"][0]
    assert math.isnan(ema.get_ydata()[0]) and ema.get_ydata()[2] > 0  # EMA columns from epoch 3 only

    for ax in fig.axes:  # marks at the start of the epoch they happened in, in every panel
        marks = sorted((line.get_xdata()[0], line.get_linestyle()) for line in ax.get_lines()
                       if line.get_label().startswith("_"))
        assert marks == [(4, "-"), (4, ":"), (8, ":")]
    assert [text.get_text() for text in loss_ax.texts] == ["world 2 -> 4"]  # resumes: the line style alone
    legend = [text.get_text() for text in loss_ax.get_legend().get_texts()]
    assert legend[-2:] == ["world size changed", "resumed from a checkpoint"]


def test_close_world_size_changes_share_one_label():
    worlds = {10: 16, 11: 8, 12: 4, 40: 16}
    rows, world = [], 8
    for epoch in range(1, 91):
        world = worlds.get(epoch, world)
        rows.append({"epoch": epoch, "train_loss": 1.0, "world_size": world})
    (loss_ax, *_) = plot.figure(rows).axes
    assert [text.get_text() for text in loss_ax.texts] == ["world 8 -> 16 -> 8 -> 4", "world 4 -> 16"]


def test_title_says_epochs_world_size_and_best_accuracies():
    rows = metric_rows()
    rows[-1]["val_top1"] = math.nan  # a failed validation is not the best
    best_top1 = max(row["val_top1"] for row in rows[:-1])
    best_ema = rows[-1]["val_top1_ema"]
    # the run's folder name, its epochs, the last world size, each best accuracy and its epoch
    assert_names(single_line(plot.title_of("/x/run", rows)), "run", "12 epochs", "world size 4",
                 f"top-1 {best_top1:.2f}%", "epoch 11", f"EMA {best_ema:.2f}%", "epoch 12")
    assert plot.title_of("/x/old/", [{"epoch": 1, "train_loss": 3.0}]) == "old: 1 epoch"


def test_figure_without_steps_draws_the_epoch_learning_rate():
    rows = [{k: v for k, v in row.items() if "ema" not in k and k != "resumed"} for row in metric_rows()]
    for row in rows:
        row["world_size"] = 2
    fig = plot.figure(rows)
    loss_ax, acc_ax, lr_ax = fig.axes
    assert line_labels(loss_ax) == ["train loss", "val loss"]
    assert line_labels(acc_ax) == ["top-1", "top-5"]
    (lr_line,) = lr_ax.get_lines()
    assert lr_line.get_label() == "end of epoch" and list(lr_line.get_xdata()) == list(range(1, EPOCHS + 1))
    assert len(loss_ax.texts) == 0 and fig.get_suptitle() == ""
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["train loss", "val loss"]


# ----------------------------------------------------------------------------- the PNG

def test_main_writes_a_png_of_the_run(run_dir, capsys):
    plot.main([str(run_dir)])
    output = run_dir / "curves.png"
    assert capsys.readouterr().out.strip() == str(output)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    import numpy as np
    image = matplotlib.image.imread(str(output))
    height, width = image.shape[:2]
    assert 800 <= width <= 2000 and 800 <= height <= 2000 and image.shape[2] in (3, 4)
    colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50  # not blank: curves, marks, text
    assert (image[..., :3] < 0.5).any()  # something dark (text, axes) on the white background


def test_output_elsewhere_and_in_other_formats(run_dir, tmp_path, capsys):
    for name in ("elsewhere.png", "curves.svg"):
        output = tmp_path / name
        plot.main([str(run_dir), "-o", str(output)])
        assert capsys.readouterr().out.strip() == str(output) and output.stat().st_size > 1000
    assert not (run_dir / "curves.png").exists()
    assert "must end in .png, .pdf, .svg" in error_line(capsys, [str(run_dir), "-o", str(tmp_path / "c.jpeg")])


# ----------------------------------------------------------------------------- errors

def test_missing_folder_and_not_a_folder(tmp_path, capsys):
    assert error_line(capsys, [str(tmp_path / "nope")]).endswith("nope: no such folder")
    (tmp_path / "file").write_text("")
    assert "not a folder" in error_line(capsys, [str(tmp_path / "file")])


def test_no_metrics_yet(tmp_path, capsys):
    line = error_line(capsys, [str(tmp_path)])
    assert "metrics.jsonl" in line and "has not completed an epoch yet" in line


def test_empty_or_broken_metrics(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n")
    assert "is empty" in error_line(capsys, [str(tmp_path)])
    path.write_text('{"epoch": 1, "train_loss": 2\n')
    assert "is not JSON lines" in error_line(capsys, [str(tmp_path)])
    path.write_text('{"train_loss": 2}\n')
    assert "line 1: expected an object with an epoch number" in error_line(capsys, [str(tmp_path)])


def test_a_torn_last_metrics_line_is_left_out_with_a_warning_as_resuming_does(run_dir, capsys):
    path = run_dir / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + b'{"epoch": 13, "train_loss": 0.9')  # the copy or the write cut short
    plot.main([str(run_dir)])
    captured = capsys.readouterr()
    assert (run_dir / "curves.png").stat().st_size > 0 and "Traceback" not in captured.err
    assert_names(single_line(captured.err), "warning", str(path))
    assert [row["epoch"] for row in plot.read_metrics(str(run_dir))] == list(range(1, EPOCHS + 1))


def test_a_damaged_metrics_line_before_the_last_is_still_refused(run_dir, capsys):
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[3] = lines[3][:20]
    path.write_text("\n".join(lines))  # and no newline after the last, which is whole
    assert_names(error_line(capsys, [str(run_dir)]), str(path))


def test_steps_with_bytes_that_are_not_utf8_lose_their_line_alone(run_dir):
    path = run_dir / "steps.jsonl"
    step_7 = b'"step": 7, "epoch": 0.35, "loss"'
    path.write_bytes(path.read_bytes().replace(step_7, step_7.replace(b"loss", b"l\xffss")))
    assert [row["step"] for row in plot.read_steps(str(run_dir))] == [s for s in range(1, 241) if s != 7]


def test_unwritable_output(run_dir, tmp_path, capsys):
    line = error_line(capsys, [str(run_dir), "-o", str(tmp_path / "missing" / "curves.png")])
    assert "cannot write" in line and "missing" in line
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "Permission denied" in error_line(capsys, [str(run_dir), "-o", str(locked / "curves.png")])


def test_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plot.main(["--nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("imagenet-elastic plot: error:")


def test_missing_matplotlib_says_how_to_install(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    line = error_line(capsys, [str(run_dir)])
    assert "matplotlib" in line and 'pip install "imagenet_elastic[plot]"' in line
    assert not (run_dir / "curves.png").exists()

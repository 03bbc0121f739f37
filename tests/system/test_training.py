"""Real training runs: torchrun with two processes, a killed plain process, exact validation, resume."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    AUGMENTED,
    EPOCHS,
    MIXED,
    SMALL_RUN,
    VAL_IMAGES,
    assert_names,
    assert_row_describes,
    assert_same_tensors,
    child_env,
    evaluate_checkpoint,
    evaluate_cmd,
    evaluated,
    finish,
    load_checkpoint,
    python_cmd,
    run,
    run_and_kill,
    start,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imagenet_elastic import cli
from imagenet_elastic.cli import build_parser
from imagenet_elastic.models.create import create_model
from imagenet_elastic.report.metrics import read as read_metrics

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.mark.multiprocess
def test_torchrun_two_processes_trains_validates_and_checkpoints(torchrun_reference):
    ckpt, stdout = torchrun_reference
    rows = read_metrics(ckpt / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["world_size"] == 2 and row["val_samples"] == VAL_IMAGES
        assert row["images_per_sec"] > 0 and row["epoch_seconds"] > 0
        assert 0 <= row["val_top1"] <= row["val_top5"] <= 100
    assert rows[-1]["val_top1"] > 50, "the learnable data set was not learned"
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    # last, best and only the newest two epoch files; the settings
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".lock", "best.pt", "config.yaml", "epoch_0002.pt", "epoch_0003.pt", "index-train.npz",
                     "index-val.npz", "last.pt", "metrics.jsonl", "steps.jsonl", "tensorboard"]
    last = load_checkpoint(ckpt / "last.pt")  # weights_only=True
    assert last["epoch"] == 3 and last["world_size"] == 2 and last["global_batch"] == 16
    assert last["best_top1"] == max(r["val_top1"] for r in rows)
    assert load_checkpoint(ckpt / "best.pt")["history"][-1]["val_top1"] == last["best_top1"]
    # rank 0 alone speaks: one startup table and one summary line per epoch
    assert stdout.count("global batch") == 1 and "16 = 2 processes x 8" in stdout
    assert "0.125 = 2 x 16/256" in stdout  # the scaled LR is said at start
    for epoch in range(1, EPOCHS + 1):
        assert stdout.count(f"epoch {epoch}/{EPOCHS}: train loss") == 1
    # every log line: the interval's mean loss over both ranks, throughput, the loader's share, two ETAs
    lines = re.findall(r"^epoch (\d)/3 step (\d+)/6 loss [\d.]+ lr [\d.]+ [\d.]+ img/s data wait \d+% \| "
                       r"ETA epoch \d+:\d\d, run \d+:\d\d$", stdout, re.MULTILINE)
    assert len(lines) == EPOCHS * 6, stdout  # --log-interval 1
    best = max(range(EPOCHS), key=lambda i: rows[i]["val_top1"])  # the first of equals, as fit keeps it
    said = [line for line in stdout.splitlines() if "imagenet-elastic export" in line]
    assert len(said) == 1, stdout  # the best score, of the raw weights, its epoch, its file, the command to export it
    assert_names(said[0], f"{rows[best]['val_top1']:.2f}%", "raw weights", f"epoch {best + 1}", f"{ckpt}/best.pt",
                 f"imagenet-elastic export {ckpt}/best.pt OUT_DIR")


@pytest.mark.multiprocess
@pytest.mark.mostly_waiting  # two processes of one thread each
def test_plain_process_killed_and_resumed_matches_uninterrupted_run(image_folder, tmp_path, warm_python):
    """With the recipe options on: every augmentation is drawn from (seed, epoch, index), so a restart redraws
    it exactly; AdamW's state, the step schedule and the weight average (updated every 2 steps, the kill at an
    odd one) continue from the checkpoint; the resumed run continues
    from last.pt, not from --initial-checkpoint (a timm state dict of 10 classes: the head is re-initialised).
    Mixup, cutmix and drop-path are drawn from (seed, step), the BCE loss takes the mixed targets, each image
    comes twice per batch with augmentations of its own (--ra-reps), the model blurs before its strided
    convolutions (--blurpool: an initial state dict of the plain model fits), and the second epoch, where the
    run is killed, trains at the ramp's larger size. And config.yaml, written beside
    the checkpoints, runs the same settings again as a new run. The processes: forks of the warm python."""
    torch.manual_seed(3)
    torch.save(create_model("test_resnet", 10).state_dict(), tmp_path / "init.pth")
    args = [str(image_folder), *SMALL_RUN, *AUGMENTED, "--epochs", "2", "--max-steps-per-epoch", "6", "--threads", "1",
            "--opt", "adamw", "--lr", "0.05", "--sched", "step", "--decay-epochs", "1", "--lr-min", "1e-4",
            "--initial-checkpoint", str(tmp_path / "init.pth"), "--model-ema", "--model-ema-decay", "0.9",
            "--model-ema-warmup", "--model-ema-steps", "2", *MIXED, "--bce-loss", "--progressive-resize", "32,64",
            "--progressive-epochs", "0,1", "--ra-reps", "2", "--clip-grad-norm", "0.5", "--blurpool"]
    clean = start(python_cmd(*args, "--checkpoints-path", str(tmp_path / "clean"), python=warm_python))
    killed_dir = str(tmp_path / "killed")
    code, output = run_and_kill(python_cmd(*args, "--checkpoints-path", killed_dir, "--resume", python=warm_python),
                                when="epoch 2/2 step 3/", victim=lambda proc: proc.pid)
    finished = finish(clean)
    assert finished.returncode == 0, finished.stderr
    assert code == -9, output
    assert "classifier re-initialised: 10 classes there, 4 here" in output
    resumed = run(python_cmd(*args, "--checkpoints-path", killed_dir, "--resume", python=warm_python))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    killed, clean = load_checkpoint(tmp_path / "killed" / "last.pt"), load_checkpoint(tmp_path / "clean" / "last.pt")
    assert_same_tensors(killed["model"], clean["model"])
    assert_same_tensors(killed["model_ema"], clean["model_ema"])
    rows = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert len(rows) == 2 and all("val_top1_ema" in row for row in rows)
    assert [row.get("resumed") for row in rows] == [None, True]  # epoch 2 was finished by the resumed process
    assert_same_curves(tmp_path / "killed", tmp_path / "clean", steps=12)
    assert [row["train_size"] for row in rows] == [32, 64]
    best = load_checkpoint(tmp_path / "killed" / "best.pt")
    best_row = rows[best["epoch"] - 1]
    assert best["best_of"] in ("model", "model_ema")
    assert best["best_top1"] == max(best_row["val_top1"], best_row["val_top1_ema"])
    saved, _ = cli.parse(["--config", str(tmp_path / "killed" / "config.yaml"), "--checkpoints-path", "/new"])
    assert saved == cli.parse([*args, "--checkpoints-path", "/new"])[0]  # where it lived left out: a new run


def assert_same_curves(resumed: Path, clean: Path, steps: int) -> None:
    """steps.jsonl and TensorBoard's events of a resumed run hold every step once, in order, with the
    uninterrupted run's values (losses summed in another order: equal to float64 rounding)."""
    rows, clean_rows = ([json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]
                        for folder in (resumed, clean))
    assert [r["step"] for r in rows] == [r["step"] for r in clean_rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in clean_rows], rel=1e-9)
    for folder, expected in ((resumed, rows), (clean, clean_rows)):
        events = EventAccumulator(str(folder / "tensorboard"))
        events.Reload()
        loss = events.Scalars("train/loss")
        assert [e.step for e in loss] == list(range(1, steps + 1))
        assert [e.value for e in loss] == pytest.approx([r["loss"] for r in expected], rel=1e-6)  # float32 there
        assert [e.step for e in events.Scalars("epoch/val_top1")] == [steps // 2, steps]


@pytest.mark.multiprocess
@pytest.mark.usefixtures("warm_ranks")  # the ranks torchrun starts: forks of the warm python
def test_validation_counts_every_image_exactly_once_for_world_sizes_1_2_3(image_folder, torchrun_reference,
                                                                           tmp_path):
    """35 images, batch 11: shards of 12/12/11 give the 3 ranks unequal batch counts (no hang, no padding).
    And each epoch's metrics row describes its checkpoint: every rank validated with rank 0's BatchNorm
    statistics, the ones saved, not its own (which its last micro-batches moved)."""
    ckpt, _ = torchrun_reference
    runs = {world_size: start(evaluate_cmd(image_folder, ckpt / "last.pt", world_size, tmp_path / str(world_size),
                                           "--batch-size", "11")) for world_size in (2, 3)}
    # one rank in this process, beside the two torchrun jobs
    results = {1: evaluate_checkpoint(image_folder, ckpt / "last.pt", 1, tmp_path / "1", "--batch-size", "11")}
    epoch_2 = evaluate_checkpoint(image_folder, ckpt / "epoch_0002.pt", 1, tmp_path / "e2")
    results.update({world_size: evaluated(finish(proc)) for world_size, proc in runs.items()})
    for result in results.values():
        assert result["val_samples"] == VAL_IMAGES
    for world_size in (2, 3):  # fp32; only the summation order differs
        assert results[world_size]["val_top1"] == results[1]["val_top1"]
        assert results[world_size]["val_top5"] == results[1]["val_top5"]
        assert results[world_size]["val_loss"] == pytest.approx(results[1]["val_loss"], rel=1e-5, abs=1e-7)
    rows = read_metrics(ckpt / "metrics.jsonl")
    assert_row_describes(rows[2], results[2], rel=1e-5)  # epoch 3 = last.pt, trained and evaluated at world size 2
    assert_row_describes(rows[1], epoch_2)


def test_console_script_is_installed_and_its_quick_exit_keeps_output_and_exit_codes():
    """cli.program ends with os._exit: buffered output must be flushed and exit codes kept."""
    result = subprocess.run(["imagenet-elastic", "--help"], env=child_env(PYTHONUNBUFFERED=""), capture_output=True,
                            text=True, timeout=60)  # block-buffered, as in a log file
    assert result.returncode == 0 and "--checkpoints-path" in result.stdout
    last_option = [line.split()[0] for line in build_parser().format_help().splitlines() if line.startswith("  -")][-1]
    assert last_option in result.stdout  # the pipe's buffer was flushed to its end
    refused = run(python_cmd("/nonexistent", "--batch-size", "0"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--batch-size" in refused.stderr

"""A run's life in one process: a fresh start, what it reports, its checkpoints (the fp16 scaler's state with
them), `--resume` continuing it without repeating a metrics row, and the run with nothing left to do."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from types import SimpleNamespace

import inprocess
import torch
from conftest import SMALL_RUN, TRAIN_IMAGES, VAL_IMAGES, assert_names, load_checkpoint

from imagenet_elastic.models.device import native_low_precision
from imagenet_elastic.report.metrics import read as read_metrics
from imagenet_elastic.train.trainer import Trainer


def test_resume_flag_starts_fresh_then_continues_without_duplicate_metrics(image_folder, tmp_path):
    args = [str(image_folder), *SMALL_RUN, "--max-steps-per-epoch", "3", "--checkpoints-path", str(tmp_path),
            "--resume"]
    first = inprocess.command([*args, "--workers", "0", "--epochs", "1"])
    assert first.returncode == 0, first.stderr
    assert "starting fresh" in first.stdout
    # a row for an epoch that no checkpoint holds (as if killed between the two writes)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 2, "val_top1": -1.0}) + "\n")
    second = inprocess.command([*args, "--workers", "0", "--epochs", "2"])
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stdout and "1 epoch done" in second.stdout
    assert second.stdout.count("(file list from the cache)") == 2  # train and val: not scanned again
    assert "epochs: checkpoint 1, now 2" in second.stderr  # a changed schedule is pointed out
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and rows[1]["val_top1"] >= 0
    best = max(r["val_top1"] for r in rows)
    assert load_checkpoint(tmp_path / "last.pt")["best_top1"] == best
    done = inprocess.command([*args, "--workers", "0", "--epochs", "2"])
    assert done.returncode == 0 and "completed all 2 epochs of --epochs 2" in done.stdout
    fewer = inprocess.command([*args, "--workers", "0", "--epochs", "1"])  # a run that asks for fewer: said as it is
    assert fewer.returncode == 0 and "completed 2 epochs, more than --epochs 1" in fewer.stdout


def test_resume_of_a_checkpoints_folder_continues_the_run_in_that_folder(image_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default --checkpoints-path would be
    folder = tmp_path / "run1"
    args = [str(image_folder), *SMALL_RUN, "--workers", "0", "--max-steps-per-epoch", "2"]
    assert inprocess.command([*args, "--epochs", "1", "--checkpoints-path", str(folder)]).returncode == 0
    resumed = inprocess.command(["--resume", str(folder), *args, "--epochs", "2"])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {folder / 'last.pt'}: 1 epoch done" in resumed.stdout
    assert load_checkpoint(folder / "last.pt")["epoch"] == 2 and not (tmp_path / "checkpoints").exists()


def test_a_resume_before_any_validation_says_so_not_a_negative_top1(image_folder, tmp_path):
    args = [str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1", "--max-steps-per-epoch", "3",
            "--checkpoints-path", str(tmp_path)]
    assert inprocess.train(args, signal_during_step=2).stopped  # a checkpoint after step 2 of epoch 1's 3
    resumed = inprocess.command([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "0 epochs done, 16 samples into epoch 1, no validation yet" in resumed.stdout
    assert "-1.00%" not in resumed.stdout


def test_training_set_size_global_batch_and_precision_are_reported(image_folder, tmp_path):
    result = inprocess.command([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1",
                                "--max-steps-per-epoch", "1", "--amp", "auto", "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert f"{TRAIN_IMAGES} in" in result.stdout and f"{VAL_IMAGES} in" in result.stdout
    assert "8 = 1 process x 8" in result.stdout
    # --amp auto on this machine's CPU, whichever kind it is: never an emulated bf16, and the reason said
    native = native_low_precision(torch.device("cpu"))["bf16"]
    expected = "bf16 (auto: this CPU has native bf16)" if native else "fp32 (auto: this CPU has no native bf16)"
    assert re.search(rf"precision\s+{re.escape(expected)}$", result.stdout, re.MULTILINE), result.stdout
    assert "warning:" not in result.stderr


def test_fp16_gradscaler_state_is_checkpointed_and_continues_after_resume(image_folder, tmp_path):
    args = [str(image_folder), *SMALL_RUN, "--amp", "fp16", "--channels-last", "--max-steps-per-epoch", "3",
            "--checkpoints-path", str(tmp_path), "--resume"]
    first = inprocess.command([*args, "--workers", "0", "--epochs", "1"])
    assert first.returncode == 0, first.stderr
    assert "fp16 + GradScaler" in first.stdout
    scaler = load_checkpoint(tmp_path / "last.pt")["scaler"]
    assert scaler["scale"] > 1 and scaler["_growth_tracker"] == 3  # three unskipped steps
    second = inprocess.command([*args, "--workers", "0", "--epochs", "2"])
    assert second.returncode == 0, second.stderr
    assert load_checkpoint(tmp_path / "last.pt")["scaler"]["_growth_tracker"] == 6  # restored, not reset


def test_a_resume_at_another_global_batch_counts_the_epochs_steps_as_they_were_trained(image_folder, tmp_path):
    """3 steps of 8 from the checkpoint, then the 72 images left in 4 steps of 16 (the last 8, a partial batch, are
    dropped as every epoch's are): the epoch had 7 steps, and its last step row is at epoch 1.0, not 7/6 of it."""
    args = [str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1", "--checkpoints-path", str(tmp_path)]
    assert inprocess.train(args, signal_during_step=3).stopped
    resumed = inprocess.command([*args, "--resume", "--global-batch-size", "16"])
    assert resumed.returncode == 0, resumed.stderr
    assert "global batch: checkpoint 8, now 16" in resumed.stderr
    assert re.findall(r"epoch 1/1 step (\d+)/(\d+)", resumed.stdout)[-1] == ("7", "7")
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(row["step"], row["epoch"]) for row in rows][-2:] == [(6, round(6 / 7, 4)), (7, 1.0)]


def test_a_resume_at_a_larger_global_batch_past_the_epochs_new_end_finishes_the_epoch(image_folder, tmp_path):
    """80 of 96 images trained in steps of 8; in steps of 64 the epoch ends at 64: nothing is left of it."""
    args = [str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "2", "--max-steps-per-epoch", "10",
            "--checkpoints-path", str(tmp_path)]
    assert inprocess.train(args, signal_during_step=10).stopped
    resumed = inprocess.command([*args, "--resume", "--global-batch-size", "64", "--max-steps-per-epoch", "1"])
    assert resumed.returncode == 0, resumed.stderr
    assert [row["epoch"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 11  # epoch 2's one step of 64


def test_a_checkpoint_without_its_settings_resumes_and_is_evaluated(image_folder, tmp_path):
    """Another program's or a hand-edited checkpoint may lack 'config': its run's sizes are then the defaults."""
    args = [str(image_folder), *SMALL_RUN, "--workers", "0", "--max-steps-per-epoch", "2", "--checkpoints-path",
            str(tmp_path)]
    inprocess.train([*args, "--epochs", "1"])
    state = torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=True)
    del state["config"]
    torch.save(state, tmp_path / "last.pt")
    for extra in (["--epochs", "2", "--resume"], ["--evaluate", "--resume", str(tmp_path / "last.pt")]):
        finished = inprocess.command([*args, *extra])
        assert finished.returncode == 0 and "Traceback" not in finished.stderr, finished.stderr


def resume_under_a_damaged_best(image_folder, one_epoch_run, tmp_path, also_remove=()):
    """Resume the one-epoch run for a second epoch that cannot beat the first (its top-1 edited to 100%), with best.pt
    replaced by text and `also_remove` removed."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(one_epoch_run, ckpt)
    state = load_checkpoint(ckpt / "last.pt")
    state["best_top1"] = state["history"][0]["val_top1"] = 100.0
    torch.save(state, tmp_path / "edited.pt")
    os.replace(tmp_path / "edited.pt", ckpt / "last.pt")  # not into the file best.pt and epoch_0001.pt share
    (ckpt / "best.pt").unlink()
    (ckpt / "best.pt").write_text("not a checkpoint")
    for name in also_remove:
        (ckpt / name).unlink()
    args = [str(image_folder), *SMALL_RUN, "--workers", "0", "--max-steps-per-epoch", "3", "--epochs", "2"]
    resumed = inprocess.command([*args, "--checkpoints-path", str(ckpt), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert any(line.startswith(f"warning: {ckpt / 'best.pt'} ") for line in resumed.stderr.splitlines())
    return ckpt, resumed


def test_a_damaged_best_is_said_at_resume_and_the_end_names_its_epochs_checkpoint_instead(image_folder,
                                                                                          one_epoch_run, tmp_path):
    ckpt, resumed = resume_under_a_damaged_best(image_folder, one_epoch_run, tmp_path)
    assert f"export {ckpt / 'epoch_0001.pt'} OUT_DIR" in resumed.stdout
    assert str(ckpt / "best.pt") not in resumed.stdout


def test_a_best_no_readable_checkpoint_holds_is_never_recommended_for_export(image_folder, one_epoch_run, tmp_path):
    ckpt, resumed = resume_under_a_damaged_best(image_folder, one_epoch_run, tmp_path, also_remove=["epoch_0001.pt"])
    assert "export" not in resumed.stdout
    assert_names(resumed.stderr.splitlines()[-1], "best.pt", "epoch_0001.pt", ckpt)


def test_the_export_command_said_for_the_best_checkpoint_pastes_back_as_its_path(tmp_path):
    best = str(tmp_path / "my run's $HOME" / "best.pt")  # a space, a quote and a $: the shell would split it bare
    said = []
    files = SimpleNamespace(readable=lambda names: best, folder=os.path.dirname(best))
    fake = SimpleNamespace(state=SimpleNamespace(history=[{"epoch": 1, "val_top1": 50.0, "val_top1_ema": 60.0}]),
                           env=SimpleNamespace(is_main=True), checkpointer=SimpleNamespace(files=files),
                           console=SimpleNamespace(info=said.append, warn=said.append))
    Trainer.say_where_the_best_is(fake)
    assert shlex.split(said[0].split("for timm: ", 1)[1]) == ["imagenet-elastic", "export", best, "OUT_DIR", "--ema"]

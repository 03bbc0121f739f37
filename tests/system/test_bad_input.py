"""Bad input: one line on stderr naming the culprit, exit code 2, no traceback, nothing on disk changed.

The command runs in this process (inprocess.command: cli.main with its output captured), with no loader worker;
the one failure that crosses a worker's process boundary (a corrupt image met by a loader worker) runs as a real
process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import inprocess
import pytest
import torch
from conftest import SMALL_RUN, expect_user_error, make_image_folder


def copy_run(one_epoch_run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(one_epoch_run, target)
    return target


def test_missing_data_folder_is_named(tmp_path, one_epoch_run):
    ckpt = copy_run(one_epoch_run, tmp_path)
    expect_user_error([str(tmp_path / "nope"), "--checkpoints-path", str(ckpt), "--resume"],
                      f"data folder {tmp_path / 'nope'} does not exist", ckpt)


def test_data_that_is_a_file_is_named_as_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    expect_user_error([str(tmp_path / "notes.txt"), "--checkpoints-path", str(tmp_path / "ck")],
                      (tmp_path / "notes.txt", "is a file", "a folder"), tmp_path)


def test_folder_without_class_folders_is_named(tmp_path):
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "val").mkdir()
    expect_user_error([str(tmp_path / "data"), "--checkpoints-path", str(tmp_path / "ck")],
                      f"train folder {tmp_path / 'data' / 'train'} has no class folders", tmp_path)


def test_train_and_val_class_lists_differ(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=2, val_per_class=1)
    shutil.rmtree(data / "val" / "class_001")
    line = expect_user_error([str(data), "--checkpoints-path", str(tmp_path / "ck")], "classes differ", data)
    assert "class_001" in line


def test_missing_validation_folder_suggests_val_path(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    shutil.rmtree(data / "val")
    expect_user_error([str(data), "--checkpoints-path", str(tmp_path / "ck")], "--val-path", data)


@pytest.mark.slow  # a process: the loader worker's failure crosses into the trainer
def test_corrupt_image_met_by_a_loader_worker_is_named_and_checkpoints_are_untouched(tmp_path, one_epoch_run):
    data = make_image_folder(tmp_path / "data", classes=4, train_per_class=4, val_per_class=1)
    bad = sorted((data / "train").rglob("*.jpg"))[5]
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 10)
    ckpt = copy_run(one_epoch_run, tmp_path)
    expect_user_error([str(data), *SMALL_RUN, "--epochs", "3", "--checkpoints-path", str(ckpt), "--resume"],
                      f"cannot decode image file {bad}", ckpt, process=True)


def test_a_truncated_jpeg_met_by_decode_gpus_thread_is_named_and_checkpoints_are_untouched(tmp_path, one_epoch_run):
    """The header parses (the worker hands the bytes over); the decode thread then fails on it, on the device
    and on the CPU: the training thread raises its error as its own."""
    data = make_image_folder(tmp_path / "data", classes=4, train_per_class=4, val_per_class=1)
    bad = sorted((data / "train").rglob("*.jpg"))[5]
    raw = bad.read_bytes()
    bad.write_bytes(raw[:raw.index(b"\xff\xda") + 20])  # the header up to the start of the scan
    ckpt = copy_run(one_epoch_run, tmp_path)
    expect_user_error([str(data), *SMALL_RUN, "--epochs", "3", "--decode", "gpu", "--checkpoints-path", str(ckpt),
                       "--resume"], f"cannot decode image file {bad}", ckpt)


def test_unknown_model_is_named_before_anything_is_written(tmp_path, image_folder):
    line = expect_user_error([str(image_folder), "--model", "resnet5O", "--checkpoints-path", str(tmp_path / "c")],
                             "--model 'resnet5O' is not a timm model", tmp_path)
    assert "resnet50" in line  # a close match is suggested
    assert not (tmp_path / "c").exists()  # not even the lock: the name is checked before the folder is made


def test_checkpoint_of_another_model_is_refused(tmp_path, image_folder, one_epoch_run):
    ckpt = copy_run(one_epoch_run, tmp_path)
    args = [str(image_folder), *SMALL_RUN, "--model", "resnet18", "--checkpoints-path", str(ckpt), "--resume"]
    expect_user_error(args, "is of model 'test_resnet', but --model is 'resnet18'", ckpt)


def test_evaluate_takes_the_model_and_validation_sizes_from_its_checkpoint_and_refuses_another_model(tmp_path,
                                                                                                     image_folder,
                                                                                                     one_epoch_run):
    """README's `DATA --evaluate --resume CKPT`, with nothing of the run repeated: the scores of the run's own
    settings, without a warning; another --model than the checkpoint's is one line."""
    command = [str(image_folder), "--evaluate", "--resume", str(one_epoch_run / "last.pt"), "--checkpoints-path",
               str(tmp_path / "scratch"), "--amp", "none"]
    alone = inprocess.command([*command, "--workers", "0"])
    assert alone.returncode == 0 and "warning" not in alone.stderr, alone.stderr
    repeated = inprocess.command([*command, *SMALL_RUN, "--workers", "0"])
    scores, again = (json.loads(run.stdout.splitlines()[-1]) for run in (alone, repeated))
    # --batch-size is not the run's to keep: batches of 8 add the float32 losses in another order than one of 35
    assert scores.pop("val_loss") == pytest.approx(again.pop("val_loss"), rel=1e-6) and scores == again
    expect_user_error([*command, "--model", "resnet18"], f"checkpoint {one_epoch_run / 'last.pt'} is of model "
                      "'test_resnet', but --model is 'resnet18'", one_epoch_run)


def test_checkpoint_with_another_class_count_is_refused(tmp_path, one_epoch_run):
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=1)
    ckpt = copy_run(one_epoch_run, tmp_path)
    expect_user_error([str(data), *SMALL_RUN, "--checkpoints-path", str(ckpt), "--resume"],
                      "has 4 classes, the data has 3", ckpt)


def test_truncated_last_checkpoint_is_reported_not_overwritten(tmp_path, image_folder, one_epoch_run):
    ckpt = copy_run(one_epoch_run, tmp_path)
    last = ckpt / "last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    expect_user_error([str(image_folder), *SMALL_RUN, "--checkpoints-path", str(ckpt), "--resume"],
                      f"checkpoint {last} is damaged", ckpt)


def test_progress_past_the_epochs_end_is_refused_as_a_damaged_checkpoint(tmp_path, image_folder, one_epoch_run):
    ckpt = copy_run(one_epoch_run, tmp_path)
    state = torch.load(ckpt / "last.pt", weights_only=True)
    state["epoch_progress"]["samples"] = 10 ** 6  # hand-edited: the epoch holds 3 steps of 8
    (ckpt / "last.pt").unlink()
    torch.save(state, ckpt / "last.pt")
    expect_user_error([str(image_folder), *SMALL_RUN, "--epochs", "2", "--max-steps-per-epoch", "3",
                       "--checkpoints-path", str(ckpt), "--resume"],
                      (ckpt / "last.pt", "'epoch_progress'", 10 ** 6), ckpt)


def test_missing_resume_path_is_named(tmp_path, image_folder):
    expect_user_error([str(image_folder), "--checkpoints-path", str(tmp_path / "c"),
                       "--resume", str(tmp_path / "gone.pt")], f"--resume {tmp_path / 'gone.pt'}", tmp_path)


def test_fresh_start_refuses_to_overwrite_an_earlier_run(tmp_path, image_folder, one_epoch_run):
    ckpt = copy_run(one_epoch_run, tmp_path)
    expect_user_error([str(image_folder), *SMALL_RUN, "--checkpoints-path", str(ckpt)], "pass --resume", ckpt)


def test_a_resume_into_a_folder_holding_another_runs_checkpoints_is_refused(tmp_path, image_folder, one_epoch_run):
    ckpt = copy_run(one_epoch_run, tmp_path)
    other = torch.load(ckpt / "last.pt", weights_only=True)
    torch.save({**other, "run_id": "another-run"}, ckpt / "last.pt")  # its run, unlike the one resumed, wrote it
    expect_user_error([str(image_folder), *SMALL_RUN, "--epochs", "2", "--checkpoints-path", str(ckpt), "--resume",
                       str(one_epoch_run / "last.pt")], f"--checkpoints-path {ckpt}", ckpt)


def test_a_run_continued_from_its_own_backup_in_its_folder_keeps_its_run_id(tmp_path, image_folder, one_epoch_run):
    ckpt = copy_run(one_epoch_run, tmp_path)
    backup = shutil.copy(one_epoch_run / "last.pt", tmp_path / "backup.pt")
    run_id = torch.load(backup, weights_only=True)["run_id"]
    assert len(run_id) == 16
    inprocess.train([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "2", "--max-steps-per-epoch", "3",
                     "--checkpoints-path", str(ckpt), "--resume", str(backup)])
    resumed = torch.load(ckpt / "last.pt", weights_only=True)
    assert (resumed["epoch"], resumed["run_id"]) == (2, run_id)


def test_micro_batches_of_one_image_a_batch_norm_cannot_train_on_are_refused_before_training(tmp_path, image_folder):
    expect_user_error([str(image_folder), *SMALL_RUN, "--global-batch-size", "3", "--batch-size", "2",
                       "--checkpoints-path", str(tmp_path / "c")], ("3 = 1 process x 3", "--batch-size"), tmp_path)


def test_a_checkpoint_continued_in_a_new_folder_is_a_run_of_its_own(tmp_path, image_folder, one_epoch_run):
    inprocess.train([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "2", "--max-steps-per-epoch", "3",
                     "--checkpoints-path", str(tmp_path / "fork"), "--resume", str(one_epoch_run / "last.pt")])
    origin, fork = (torch.load(folder / "last.pt", weights_only=True) for folder in (one_epoch_run, tmp_path / "fork"))
    assert fork["epoch"] == 2 and len(fork["run_id"]) == 16 and fork["run_id"] != origin["run_id"]


@pytest.mark.parametrize("value", ["0", "-3", "eight"])
def test_bad_batch_size_is_named(tmp_path, image_folder, value):
    expect_user_error([str(image_folder), "--batch-size", value], "--batch-size", tmp_path)


def test_batch_larger_than_training_set_is_explained(tmp_path, image_folder):
    expect_user_error([str(image_folder), *SMALL_RUN, "--batch-size", "1000", "--checkpoints-path",
                       str(tmp_path / "c")], "fewer than one global batch", tmp_path)


def test_unwritable_checkpoints_path_is_named(tmp_path, image_folder):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    expect_user_error([str(image_folder), *SMALL_RUN, "--checkpoints-path", str(blocker / "ckpt")],
                      f"checkpoints path {blocker / 'ckpt'} is not writable", tmp_path)


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "best.pt"])
def test_a_folder_where_a_save_writes_a_file_is_named_before_training(tmp_path, image_folder, name):
    """Found at start (exit 2), not by the first epoch's save (exit 74 after an epoch's work)."""
    (tmp_path / "ckpt" / name).mkdir(parents=True)
    expect_user_error([str(image_folder), *SMALL_RUN, "--checkpoints-path", str(tmp_path / "ckpt")],
                      str(tmp_path / "ckpt" / name), tmp_path)


def test_evaluate_without_checkpoint_is_explained(tmp_path, image_folder):
    expect_user_error([str(image_folder), *SMALL_RUN, "--evaluate", "--checkpoints-path", str(tmp_path / "c")],
                      "--evaluate needs a checkpoint", tmp_path)


def test_an_initial_checkpoint_that_is_not_one_is_named_and_nothing_is_written(tmp_path, image_folder):
    bogus = tmp_path / "weights.pth"
    bogus.write_bytes(b"these are not weights" * 20)
    ckpt = tmp_path / "ckpt"
    expect_user_error([str(image_folder), *SMALL_RUN, "--initial-checkpoint", str(bogus), "--checkpoints-path",
                       str(ckpt)], f"--initial-checkpoint {bogus} is not a checkpoint or state dict", tmp_path)


def test_a_config_file_with_an_unknown_key_is_named(tmp_path, image_folder):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("epochs: 3\nmixup: 0.2\n")
    expect_user_error([str(image_folder), "--config", str(recipe), "--checkpoints-path", str(tmp_path / "c")],
                      f"config file {recipe}: unknown option 'mixup'", tmp_path)


@pytest.fixture(scope="module")
def small_pack(image_folder, tmp_path_factory) -> Path:
    from makers import run_pack

    out = tmp_path_factory.mktemp("small_pack") / "pack"
    run_pack(str(image_folder), str(out), "--shard-size", "32")
    return out


def test_a_pack_shard_changed_after_packing_is_named_before_anything_starts(small_pack, tmp_path):
    data = tmp_path / "pack"
    shutil.copytree(small_pack, data)
    shard = data / "train" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:-1024])  # cut short, as an interrupted copy leaves it
    expect_user_error([str(data), *SMALL_RUN, "--checkpoints-path", str(tmp_path / "ck")],
                      f"shard {shard} has {shard.stat().st_size} bytes but its index", tmp_path)


def test_a_damaged_pack_index_is_one_line_naming_it_and_the_pack_command_that_writes_it_again(small_pack, image_folder,
                                                                                              tmp_path):
    data = tmp_path / "pack"
    shutil.copytree(small_pack, data)
    index = data / "val" / "imagenet-elastic-index.npz"
    index.write_bytes(index.read_bytes()[:100])
    expect_user_error([str(data), *SMALL_RUN, "--checkpoints-path", str(tmp_path / "ck")],
                      # the index, its damage, the command that writes it again, and the other remedy: remove it
                      (str(index), "File is not a zip file",
                       f"imagenet-elastic pack {image_folder} NEW_OUT --shard-size 32", str(index)), tmp_path)


def test_a_damaged_file_list_cache_costs_one_warning_and_is_written_again(image_folder, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "index-train.npz").write_bytes(b"")  # a disk that filled up as it was written, say
    done = inprocess.command([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1",
                              "--max-steps-per-epoch", "1", "--checkpoints-path", str(ckpt)])
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: the file-list cache {ckpt / 'index-train.npz'} is empty: {image_folder / 'train'} "
                        "was scanned again"], done.stderr
    from imagenet_elastic.data.sources.image_folder import read_cache

    assert read_cache(str(ckpt / "index-train.npz"), str(image_folder / "train")) is not None


def test_a_corrupt_image_inside_a_shard_is_named_by_shard_and_member(small_pack, tmp_path):
    data = tmp_path / "pack"
    shutil.copytree(small_pack, data)
    shard = data / "train" / "shard-000000.tar"
    from imagenet_elastic.data.sources import tar_shards

    packed = tar_shards.open_split(str(data / "train"), "train", None)
    start = int(packed.offsets[1])  # the second sample's image
    raw = bytearray(shard.read_bytes())
    raw[start:start + 400] = b"\0" * 400  # the JPEG's header is gone: nothing decodes it; the size is the same
    shard.write_bytes(bytes(raw))
    expect_user_error([str(data), *SMALL_RUN, "--epochs", "1", "--checkpoints-path", str(tmp_path / "ck")],
                      f"shard {shard} member {packed.member(1)} has other bytes than when it was packed",
                      tmp_path / "pack")


@pytest.mark.slow  # a process: the checksum is compared in the loader worker that reads the sample
def test_one_byte_changed_inside_a_packed_image_stops_the_run_in_its_loader_worker_naming_shard_and_member(
        small_pack, image_folder, tmp_path):
    """The bytes a decoder would take with a warning naming nothing (libjpeg's "Corrupt JPEG data"), at the same
    size, in place: refused at the sample, with the pack command."""
    from makers import flip_byte_in_place, middle_of_image

    from imagenet_elastic.data.sources import tar_shards

    data = tmp_path / "pack"
    shutil.copytree(small_pack, data)
    packed = tar_shards.open_split(str(data / "train"), "train", None)
    i = 40  # the 9th sample of the second shard
    shard = data / "train" / "shard-000001.tar"
    flip_byte_in_place(shard, middle_of_image(packed, i))
    line = expect_user_error([str(data), *SMALL_RUN, "--epochs", "1", "--checkpoints-path", str(tmp_path / "ck")],
                             f"shard {shard} member {packed.member(i)} has other bytes", tmp_path / "pack",
                             process=True)
    assert f"pack again (imagenet-elastic pack {image_folder} NEW_OUT --shard-size 32)" in line, line


def test_a_labels_file_naming_a_class_the_training_set_lacks_is_named_by_line(image_folder, tmp_path):
    (tmp_path / "flat").mkdir()
    one = next((image_folder / "val").rglob("*.jpg"))
    shutil.copy(one, tmp_path / "flat" / "a.JPEG")
    (tmp_path / "labels.csv").write_text("a.JPEG,n01440764\n")
    expect_user_error([str(image_folder), "--val-path", str(tmp_path / "flat"), "--val-labels",
                       str(tmp_path / "labels.csv"), "--checkpoints-path", str(tmp_path / "ck")],
                      # the flag, its file and line, the class, the image, the split it is not a class of
                      ("--val-labels", str(tmp_path / "labels.csv"), "line 1", "'n01440764'", "a.JPEG", "training"),
                      tmp_path)

"""Each split's fingerprint in the checkpoint (data/sources/fingerprints.py): a resume, or --evaluate, on data that
differs from the checkpoint's run's is one warning naming the counts and the first sample that differs; the same
data, or a checkpoint from before fingerprints, says nothing."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import inprocess
import numpy as np
import pytest
import torch
from conftest import SMALL_RUN, assert_names, load_checkpoint, make_image_folder, single_line
from index_memory import synthetic_index

from imagenet_elastic.data.sources import fingerprints, tar_shards
from imagenet_elastic.data.sources.image_folder import scan_image_folder

DIFFERS = "resumed run differs from its checkpoint, results will not match exactly: "


def add_images(split, names: list[str]) -> None:
    """Copies of the split's first image under new names, in the class folder each name starts with."""
    first = sorted(split.rglob("*.jpg"))[0]
    for name in names:
        shutil.copy(first, split / name)


def first_difference(before, after) -> int:
    return next(i for i in range(min(len(before), len(after))) if before.paths[i] != after.paths[i])


def test_a_split_with_images_added_differs_naming_both_counts_and_the_first_new_image(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=3, train_per_class=6, val_per_class=1)
    before = scan_image_folder(str(root / "train"), "train")
    saved = fingerprints.fingerprint(before).saved()
    assert fingerprints.difference(saved, before) is None
    add_images(root / "train", ["class_001/a_new.jpg", "class_002/b_new.jpg"])
    after = scan_image_folder(str(root / "train"), "train")
    k = first_difference(before, after)
    assert after.path(k).endswith("a_new.jpg")
    said = fingerprints.difference(saved, after)
    assert said is not None
    # the split, the checkpoint's count and today's, the first sample that differs and what lies there now
    assert_names(single_line(said), "train data", "18", "20", f"#{k}", after.path(k))


def test_a_label_changed_under_the_same_names_differs_at_that_sample():
    index = synthetic_index(3000)
    saved = fingerprints.fingerprint(index).saved()
    labels = index.labels.copy()
    labels[1234] += 1
    said = fingerprints.difference(saved, dataclasses.replace(index, labels=labels))
    assert said is not None and "3,000 samples in the checkpoint's run, 3,000 now" in said
    assert said.endswith(f"is #1,234, now {index.path(1234)}"), said


def test_samples_gone_at_the_end_are_named_gone_and_samples_added_there_by_the_first_new_one():
    index = synthetic_index(1000)
    shorter = dataclasses.replace(index, paths=index.paths[:990], labels=index.labels[:990])
    gone = fingerprints.difference(fingerprints.fingerprint(index).saved(), shorter)
    assert gone is not None and "1,000 samples in the checkpoint's run, 990 now" in gone and "#990, is gone" in gone
    added = fingerprints.difference(fingerprints.fingerprint(shorter).saved(), index)
    assert added is not None and added.endswith(f"is #990, now {index.path(990)}"), added


def test_a_large_split_is_kept_in_at_most_4096_blocks_and_names_the_block_where_it_first_differs():
    index = synthetic_index(100_000)
    taken = fingerprints.fingerprint(index)
    assert taken.block == 25 and len(taken.blocks) == 4000 * fingerprints.DIGEST_BYTES
    paths = np.insert(index.paths, 50_010, b"n00000500/a_new.JPEG")
    said = fingerprints.difference(taken.saved(), dataclasses.replace(index, paths=paths,
                                                                      labels=np.insert(index.labels, 50_010, 500)))
    assert said is not None and "100,000 samples in the checkpoint's run, 100,001 now" in said
    assert said.endswith(f"lies in samples #50,000-#50,024, now from {index.path(50_000)}"), said


def test_a_longer_name_added_changes_no_block_before_it():
    """numpy widens every fixed-width name to the longest: the fingerprint takes each name's own bytes."""
    index = synthetic_index(2000)
    longer = np.array([*index.paths.tolist(), b"n00000999/" + b"x" * 60 + b".JPEG"])
    assert longer.dtype.itemsize > index.paths.dtype.itemsize
    grown = fingerprints.fingerprint(dataclasses.replace(index, paths=longer, labels=np.append(index.labels, 999)))
    assert grown.blocks[:2000 * fingerprints.DIGEST_BYTES] == fingerprints.fingerprint(index).blocks


def test_shards_give_the_same_fingerprint_wherever_they_lie_and_another_after_a_relabel(written, tmp_path):
    from makers import relabel_in_place

    paths, _ = written
    copy = tmp_path / "elsewhere"
    shutil.copytree(os.path.dirname(paths[0]), copy)
    here = tar_shards.open_split(os.path.dirname(paths[0]), "train", None)
    there = tar_shards.open_split(str(copy), "train", None)
    assert fingerprints.fingerprint(here) == fingerprints.fingerprint(there)
    relabel_in_place(copy / "part-0001.tar", 2, (here.label(22) + 1) % 4)
    said = fingerprints.difference(fingerprints.fingerprint(here).saved(), tar_shards.open_split(str(copy), "train",
                                                                                                None))
    assert said is not None and said.endswith(f"is #22, now {copy / 'part-0001.tar'}:sample00022.jpg"), said


def test_parquet_files_give_the_same_fingerprint_wherever_they_lie_and_name_the_file_whose_rows_changed(
        image_folder, tmp_path):
    pytest.importorskip("pyarrow")
    from makers import hub_folder, write_parquet

    from imagenet_elastic.data import sources

    hub = hub_folder(image_folder, tmp_path / "hub")
    copy = tmp_path / "elsewhere"
    shutil.copytree(hub, copy)
    here, _ = sources.open_splits(str(hub), None, None, None)
    there, _ = sources.open_splits(str(copy), None, None, None)
    assert fingerprints.fingerprint(here) == fingerprints.fingerprint(there)
    second = copy / "data" / "train-00001-of-00002.parquet"
    half = len(here) // 2
    write_parquet(second, [here.read(i) for i in range(half, len(here) - 1)],
                  [here.label(i) for i in range(half, len(here) - 1)], here.classes, 7)  # its last row gone
    after, _ = sources.open_splits(str(copy), None, None, None)
    said = fingerprints.difference(fingerprints.fingerprint(here).saved(), after)
    assert said is not None and f"{len(here)} samples in the checkpoint's run, {len(here) - 1} now" in said
    assert said.endswith(f"is #{half}, now {second}:0:img0.JPEG"), said  # the file changed size: its first row differs


@pytest.fixture(scope="module")
def written(image_folder, tmp_path_factory):
    from makers import wds_shards

    return wds_shards(image_folder / "train", tmp_path_factory.mktemp("wds") / "train"), None


def run_args(data, checkpoints, *extra: str) -> list[str]:
    return [str(data), *SMALL_RUN, "--workers", "0", "--checkpoints-path", str(checkpoints), *extra]


def data_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " data: " in line and line.startswith("warning: ")]


def test_a_mid_epoch_resume_on_a_train_folder_with_five_images_added_warns_once_with_the_counts_and_first_new_image(
        tmp_path):
    """The issue's case: the checkpoint keeps each split's fingerprint; a resume on the same data says nothing of
    it, one on five more images says so once (the rest of the epoch follows another order)."""
    root = make_image_folder(tmp_path / "data", classes=4, train_per_class=8, val_per_class=2)
    stopped = inprocess.train(run_args(root, tmp_path / "ck", "--epochs", "2"), signal_during_step=2)
    assert stopped.stopped and stopped.saved_at_steps == [2]
    kept = load_checkpoint(tmp_path / "ck" / "last.pt")["data"]
    assert (kept["train"]["count"], kept["val"]["count"]) == (32, 8)
    before = scan_image_folder(str(root / "train"), "train")
    add_images(root / "train", [f"class_{k % 4:03d}/added_{k}.jpg" for k in range(5)])
    after = scan_image_folder(str(root / "train"), "train")
    resumed = inprocess.command(run_args(root, tmp_path / "ck", "--epochs", "2", "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    k = first_difference(before, after)
    (said,) = data_warnings(resumed.stderr)
    assert said.startswith(f"warning: {DIFFERS}train data: 32 samples in the checkpoint's run, 37 now"), said
    assert said.endswith(f"the first that differs is #{k}, now {after.path(k)}"), said
    assert load_checkpoint(tmp_path / "ck" / "last.pt")["data"]["train"]["count"] == 37  # what it now trained on
    again = inprocess.command(run_args(root, tmp_path / "ck", "--epochs", "3", "--resume"))
    assert again.returncode == 0 and data_warnings(again.stderr) == [], again.stderr


def one_epoch(tmp_path) -> Path:
    """A data root of 4 classes (4 training and 2 validation images each) and one epoch on it, in tmp_path/ck."""
    root = make_image_folder(tmp_path / "data", classes=4, train_per_class=4, val_per_class=2)
    done = inprocess.command(run_args(root, tmp_path / "ck", "--epochs", "1"))
    assert done.returncode == 0, done.stderr
    return root


def test_evaluate_on_other_validation_data_warns_once_and_on_other_training_data_says_nothing(tmp_path):
    root = one_epoch(tmp_path)
    add_images(root / "train", ["class_000/more.jpg"])  # --evaluate scores val: the train split is not its data
    evaluate = ["--evaluate", "--resume", str(tmp_path / "ck" / "last.pt")]
    same = inprocess.command(run_args(root, tmp_path / "scratch", *evaluate))
    assert same.returncode == 0 and data_warnings(same.stderr) == [], same.stderr
    (root / "val" / "class_003" / sorted(p.name for p in (root / "val" / "class_003").iterdir())[-1]).unlink()
    other = inprocess.command(run_args(root, tmp_path / "scratch", *evaluate))
    assert other.returncode == 0, other.stderr
    (said,) = data_warnings(other.stderr)
    # a warning, of --evaluate: the split, the checkpoint's count and today's, the first sample that differs, gone
    assert_names(said, "warning: ", "--evaluate", "val data", "8", "7", "#7", "gone")


def test_a_checkpoint_from_before_fingerprints_resumes_on_changed_data_without_a_word_of_it(tmp_path):
    root = one_epoch(tmp_path)
    old = load_checkpoint(tmp_path / "ck" / "last.pt")
    del old["data"]
    torch.save(old, tmp_path / "ck" / "last.pt")
    add_images(root / "train", ["class_002/added.jpg"])
    resumed = inprocess.command(run_args(root, tmp_path / "ck", "--epochs", "2", "--resume"))
    assert resumed.returncode == 0 and data_warnings(resumed.stderr) == [], resumed.stderr


def test_the_evaluate_tool_says_which_val_set_is_the_one_the_checkpoints_run_validated_on(tmp_path):
    """A field of each line, not a warning: scoring other sets (ImageNet-V2, a changed copy) is the tool's purpose."""
    import json

    from imagenet_elastic.tools.export import export

    root = one_epoch(tmp_path)
    other = tmp_path / "other_val"
    shutil.copytree(root / "val", other)
    add_images(other, ["class_000/more.jpg"])
    scored = inprocess.command(["evaluate", str(tmp_path / "ck" / "last.pt"), str(root / "val"), str(other),
                                "--workers", "0", "--amp", "none"])
    assert scored.returncode == 0 and "warning" not in scored.stderr, scored.stderr
    rows = [json.loads(line) for line in scored.stdout.splitlines() if line.startswith("{")]
    assert [(row["images"], row["val_as_trained"]) for row in rows] == [(8, True), (9, False)]
    export(str(tmp_path / "ck" / "last.pt"), str(tmp_path / "export"), ema=False)
    exported = inprocess.command(["evaluate", str(tmp_path / "export"), str(root / "val"), "--workers", "0"])
    assert exported.returncode == 0, exported.stderr
    assert "val_as_trained" not in exported.stdout  # an export keeps no fingerprint

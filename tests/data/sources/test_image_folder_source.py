"""A folder of class folders as a source: what a scan finds, the errors it names, the cache that saves
re-scanning, and how DATA and --val-path name the splits."""

from __future__ import annotations

import os
import shutil
import time
import types

import numpy as np
import pytest
from conftest import assert_names, single_line
from makers import damage, make_split, write_jpeg

from imagenet_elastic.data.sources import check_same_classes, evaluated_split, open_splits
from imagenet_elastic.data.sources import split_locations as resolve_split_dirs
from imagenet_elastic.data.sources.image_folder import (
    cache_path,
    read_cache,
    scan_image_folder,
    write_cache,
)
from imagenet_elastic.data.sources.image_folder import open_split as load_index
from imagenet_elastic.errors import UserError


def test_scan_image_folder_indexes_sorted_classes_and_images(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"b_class": 2, "a_class": 3})
    (root / "a_class" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    write_jpeg(str(root / "b_class" / "nested" / "deep.JPEG"), 8, 8, seed=1)
    index = scan_image_folder(str(root), "train")
    assert index.classes == ("a_class", "b_class")
    assert len(index) == 6
    assert index.labels.tolist() == [0, 0, 0, 1, 1, 1]
    paths = [index.path(i) for i in range(len(index))]
    assert all(os.path.isfile(p) for p in paths)
    assert str(root / "b_class" / "nested" / "deep.JPEG") in paths
    assert not any(p.endswith(".txt") for p in paths)


def test_scan_image_folder_missing_folder_names_role_and_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(UserError, match="does not exist") as caught:
        scan_image_folder(missing, "val")
    assert f"val folder {missing}" in str(caught.value)


def test_scan_image_folder_without_class_folders(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    write_jpeg(str(root / "img.jpg"), 8, 8, seed=0)
    with pytest.raises(UserError, match="has no class folders") as caught:
        scan_image_folder(str(root), "train")
    assert f"train folder {root}" in str(caught.value)
    assert "CLASS/IMAGE.jpg" in str(caught.value)


def test_scan_image_folder_with_an_empty_class_folder_names_it(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"full": 1})
    (root / "empty").mkdir()
    (root / "empty" / "readme.txt").write_text("x")
    with pytest.raises(UserError, match="has no images") as caught:
        scan_image_folder(str(root), "train")
    assert str(root / "empty") in str(caught.value)


def test_an_image_whose_name_is_not_utf8_is_read_and_cached_by_its_bytes_and_named_printably(tmp_path):
    """Linux file names are bytes: one that is not UTF-8 (os.fsdecode keeps it as a surrogate) is listed, read,
    fingerprinted and cached by its bytes, and messages show its odd byte as \\xff."""
    root = tmp_path / "train"
    make_split(root, {"a": 2})
    odd = os.fsencode(root / "a") + b"/caf\xff.jpg"
    os.rename(root / "a" / "img1.jpg", odd)
    index = scan_image_folder(str(root), "train")
    i = [index.path(k) for k in range(len(index))].index(os.fsdecode(odd))
    assert index.paths[i] == b"a/caf\xff.jpg"
    assert index.read(i) == (root / "a" / os.fsdecode(b"caf\xff.jpg")).read_bytes()
    assert index.name(i) == str(root / "a" / "caf") + "\\xff.jpg"
    assert index.fingerprint().count == 2
    (tmp_path / "ckpt").mkdir()
    index.keep(str(tmp_path / "ckpt"))
    loaded = load_index(str(root), "train", str(tmp_path / "ckpt"))
    assert loaded.cached and loaded.read(i) == index.read(i)


def test_a_class_folder_whose_name_is_not_utf8_is_refused_naming_it(tmp_path):
    """A class name is kept as text (checkpoints, exported models): a folder name that is not UTF-8 has none."""
    root = tmp_path / "train"
    make_split(root, {"ant": 1, "bee": 1})
    os.rename(root / "bee", os.fsencode(root) + b"/b\xffe")
    with pytest.raises(UserError) as caught:
        scan_image_folder(str(root), "train")
    assert str(root / "b") + "\\xffe" in str(caught.value)


def test_a_class_folder_that_is_a_link_to_nothing_is_refused_naming_it(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"here": 1})
    os.symlink(tmp_path / "unmounted" / "gone", root / "gone")
    with pytest.raises(UserError) as caught:
        scan_image_folder(str(root), "train")
    assert_names(single_line(str(caught.value)), root / "gone", tmp_path / "unmounted" / "gone")


def test_resolve_split_dirs_finds_train_and_val(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    assert resolve_split_dirs(str(tmp_path), None) == (str(tmp_path / "train"), str(tmp_path / "val"))


def test_resolve_split_dirs_uses_data_without_train_as_the_train_folder(tmp_path):
    data = tmp_path / "data"
    (data / "n01").mkdir(parents=True)
    (tmp_path / "held_out").mkdir()
    train, val = resolve_split_dirs(str(data), str(tmp_path / "held_out"))
    assert train == str(data)
    assert val == str(tmp_path / "held_out")


def test_resolve_split_dirs_missing_data_folder(tmp_path):
    with pytest.raises(UserError, match="data folder .* does not exist") as caught:
        resolve_split_dirs(str(tmp_path / "missing"), None)
    assert str(tmp_path / "missing") in str(caught.value)


def test_resolve_split_dirs_missing_default_val_suggests_val_path(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(UserError, match="validation folder") as caught:
        resolve_split_dirs(str(tmp_path), None)
    assert str(tmp_path / "val") in str(caught.value)
    assert "--val-path" in str(caught.value)


def test_resolve_split_dirs_missing_explicit_val_path_names_it(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    with pytest.raises(UserError, match="validation folder") as caught:
        resolve_split_dirs(str(tmp_path), str(tmp_path / "other"))
    assert str(tmp_path / "other") in str(caught.value)
    assert "--val-path" not in str(caught.value)


@pytest.fixture
def small_root(tmp_path):
    for split in ("train", "val"):
        make_split(tmp_path / "data" / split, {"a": 1, "b": 1}, size=(8, 8))
    return tmp_path / "data"


@pytest.mark.parametrize(("inside", "split"), [("train", "train"), ("train/newclass", "train"), ("val/a/b", "val"),
                                               ("link/ck", "train")])
def test_a_checkpoints_folder_inside_a_split_is_refused_naming_flag_and_split_before_anything_is_written(
        small_root, inside, split):
    (small_root / "link").symlink_to(small_root / "train")  # the same folder by another name
    listed = sorted(small_root.rglob("*"))
    with pytest.raises(UserError) as caught:
        open_splits(str(small_root), None, None, str(small_root / inside))
    assert_names(single_line(str(caught.value)), "--checkpoints-path", small_root / inside, small_root / split)
    assert sorted(small_root.rglob("*")) == listed


@pytest.mark.parametrize("beside", ["../checkpoints", ".", "runs/1"])
def test_a_checkpoints_folder_beside_the_splits_or_holding_them_is_accepted(small_root, beside):
    train, val = open_splits(str(small_root), None, None, os.path.normpath(small_root / beside))
    assert len(train) == len(val) == 2


def test_evaluate_scores_the_val_split_of_a_root_that_holds_val_alone_not_a_class_named_val(tmp_path):
    root = tmp_path / "root"
    make_split(root / "val", {"a": 1, "b": 1})
    assert evaluated_split(str(root)) == str(root / "val")
    assert evaluated_split(f"folder:{root}") == f"folder:{root / 'val'}"
    assert evaluated_split(str(root / "val")) == str(root / "val")  # a split itself: its class folders


def test_evaluate_scores_a_split_whose_one_class_is_named_val_as_the_split_itself(tmp_path):
    """val/ of images alone is a class, not a root's split: unless --val-labels makes it a flat split."""
    split = tmp_path / "split"
    make_split(split, {"val": 2})
    assert evaluated_split(str(split)) == str(split)
    assert evaluated_split(str(split), str(tmp_path / "labels.csv")) == str(split / "val")
    (tmp_path / "root" / "val").mkdir(parents=True)
    (tmp_path / "root" / "val" / "part-0000.tar").write_bytes(b"")  # shards: the root's val split
    assert evaluated_split(str(tmp_path / "root")) == str(tmp_path / "root" / "val")


def test_evaluate_scores_a_split_with_a_class_named_val_among_others_as_the_split_itself(tmp_path):
    split = tmp_path / "split"
    make_split(split, {"apple": 1, "val": 1})
    assert evaluated_split(str(split)) == str(split)
    root = tmp_path / "root"
    make_split(root / "val", {"apple": 1, "val": 1})
    (root / ".cache").mkdir()  # hidden: val/ is still the root's only folder
    assert evaluated_split(str(root)) == str(root / "val")


def test_check_same_classes_accepts_equal_class_lists(tmp_path):
    make_split(tmp_path / "train", {"a": 1, "b": 1})
    make_split(tmp_path / "val", {"a": 1, "b": 1})
    check_same_classes(scan_image_folder(str(tmp_path / "train"), "train"),
                       scan_image_folder(str(tmp_path / "val"), "val"))


def test_check_same_classes_reports_the_differing_classes(tmp_path):
    make_split(tmp_path / "train", {"a": 1, "b": 1, "c": 1})
    make_split(tmp_path / "val", {"a": 1, "z": 1})
    with pytest.raises(UserError, match="classes differ") as caught:
        check_same_classes(scan_image_folder(str(tmp_path / "train"), "train"),
                           scan_image_folder(str(tmp_path / "val"), "val"))
    message = str(caught.value)
    assert "3 vs 2 classes" in message
    assert "only in train: ['b', 'c']" in message
    assert "only in val: ['z']" in message
    assert str(tmp_path / "train") in message and str(tmp_path / "val") in message


# ----------------------------------------------------------------------------- the cache

@pytest.fixture
def cached_split(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"a": 3, "b": 2})
    write_jpeg(str(root / "b" / "nested" / "deep.jpg"), 8, 8, seed=1)
    index = scan_image_folder(str(root), "train")
    (tmp_path / "ckpt").mkdir()
    write_cache(index, cache_path(str(tmp_path / "ckpt"), "train"))
    return root, str(tmp_path / "ckpt"), index


def assert_same_index(a, b) -> None:
    assert a.classes == b.classes and a.root == b.root
    np.testing.assert_array_equal(a.paths, b.paths)
    np.testing.assert_array_equal(a.labels, b.labels)


def test_unchanged_tree_is_read_from_the_cache(cached_split):
    root, cache, scanned = cached_split
    loaded = load_index(str(root), "train", cache)
    assert loaded.cached and not scanned.cached
    assert_same_index(loaded, scanned)
    assert loaded.paths.dtype.kind == "S" and loaded.labels.dtype == np.int64  # compact arrays, no object lists


@pytest.mark.parametrize("change", ["add", "remove", "rename", "add nested", "new class"])
def test_any_change_to_the_tree_makes_the_cache_stale(cached_split, change):
    root, cache, _ = cached_split
    time.sleep(0.01)  # a new mtime even on coarse clocks
    if change == "add":
        write_jpeg(str(root / "a" / "new.jpg"), 8, 8, seed=2)
    elif change == "remove":
        next((root / "a").glob("*.jpg")).unlink()
    elif change == "rename":
        first = next((root / "a").glob("*.jpg"))
        first.rename(first.with_name("renamed.jpg"))
    elif change == "add nested":
        write_jpeg(str(root / "b" / "nested" / "other.jpg"), 8, 8, seed=3)
    else:
        write_jpeg(str(root / "c" / "one.jpg"), 8, 8, seed=4)
    assert read_cache(cache_path(cache, "train"), str(root)) is None
    fresh = load_index(str(root), "train", cache)
    assert not fresh.cached
    assert_same_index(fresh, scan_image_folder(str(root), "train"))


def test_cache_of_another_root_is_not_used(cached_split, tmp_path):
    root, cache, _ = cached_split
    other = tmp_path / "other"
    make_split(other, {"a": 3, "b": 2})
    assert read_cache(cache_path(cache, "train"), str(other)) is None


@pytest.mark.parametrize("how", ["empty", "cut short", "not an npz", "an array missing"])
def test_a_damaged_cache_is_scanned_again_with_a_note_naming_it(cached_split, how):
    root, cache, scanned = cached_split
    said = damage(cache_path(cache, "train"), how)
    fresh = load_index(str(root), "train", cache)
    assert not fresh.cached
    assert_same_index(fresh, scanned)
    assert fresh.notes == (f"the file-list cache {cache_path(cache, 'train')} {said}: {root} was scanned again",)
    fresh.keep(cache)  # written again whole: the next start reads it, without a note
    again = load_index(str(root), "train", cache)
    assert again.cached and again.notes == ()


def test_another_copy_at_the_same_path_with_the_same_mtimes_but_a_file_less_is_scanned(cached_split, tmp_path):
    """Another node's copy of the data at the same path (rsync -a keeps the folders' mtimes), lacking one
    file, reads the shared cache written from the first copy: the root's inode tells the copies apart."""
    root, cache, scanned = cached_split
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)  # copy2 and copystat: the files' and folders' mtimes, to the nanosecond
    lost = copy / "a" / scanned.paths[0].decode().split("/", 1)[1]
    folder_times = os.stat(lost.parent)
    lost.unlink()
    os.utime(lost.parent, ns=(folder_times.st_atime_ns, folder_times.st_mtime_ns))
    root.rename(tmp_path / "first")
    copy.rename(root)  # the same path, the same folder mtimes, one image fewer
    assert read_cache(cache_path(cache, "train"), str(root)) is None
    fresh = load_index(str(root), "train", cache)
    assert not fresh.cached and len(fresh) == len(scanned) - 1


def test_removed_folder_makes_the_cache_stale(cached_split):
    root, cache, _ = cached_split
    for path in (root / "b" / "nested").iterdir():
        path.unlink()
    (root / "b" / "nested").rmdir()
    assert read_cache(cache_path(cache, "train"), str(root)) is None



def test_check_same_classes_says_when_the_same_names_come_in_another_order(tmp_path):
    """Numbered shards (0, 1, 2, ..., 10) beside numbered class folders (sorted 0, 1, 10, 2, ...): the same names."""
    def named(classes, where):  # all check_same_classes asks of a split
        return types.SimpleNamespace(classes=classes, where=lambda: where)

    with pytest.raises(UserError) as caught:
        check_same_classes(named(("0", "1", "2", "10"), "shards"), named(("0", "1", "10", "2"), "folders"))
    assert_names(single_line(str(caught.value)), "same 4 classes in another order", "label 2", "'2' in train",
                 "'10' in val")


def test_a_symbolic_link_back_to_a_folder_above_is_one_line_naming_it_not_an_endless_walk(tmp_path):
    make_split(tmp_path / "train", {"a": 1, "b": 1})
    os.symlink("..", tmp_path / "train" / "b" / "up")
    with pytest.raises(UserError) as caught:
        scan_image_folder(str(tmp_path / "train"), "train")
    assert_names(single_line(str(caught.value)), tmp_path / "train" / "b" / "up", "loop of symbolic links")


def test_hidden_files_and_folders_in_a_class_folder_are_not_images(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"a": 2, "b": 1})
    (root / "a" / "._a_0.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble, not a JPEG")
    write_jpeg(str(root / "b" / ".ipynb_checkpoints" / "copy.jpg"), 8, 8, seed=2)
    index = scan_image_folder(str(root), "train")
    assert len(index) == 3 and index.labels.tolist() == [0, 0, 1]
    assert not any(os.fsdecode(p).split(os.sep)[-1].startswith(".") or ".ipynb" in os.fsdecode(p) for p in index.paths)


@pytest.mark.parametrize("inside", [(), ("val",)])
def test_a_class_named_train_of_images_beside_class_folders_is_refused_naming_it_not_taken_as_the_train_split(
        tmp_path, inside):
    data = tmp_path / "data"
    make_split(data, {"cat": 1, "dog": 1, "train": 2, **{name: 1 for name in inside}})
    with pytest.raises(UserError) as caught:
        resolve_split_dirs(str(data), str(tmp_path / "held_out"))
    assert_names(single_line(str(caught.value)), data, data / "train", "cat, dog")


def test_a_root_whose_train_split_is_class_folders_shards_or_a_flat_val_beside_other_folders_is_still_a_root(
        tmp_path):
    make_split(tmp_path / "root" / "train", {"a": 1})
    make_split(tmp_path / "root" / "test", {"x": 1})
    write_jpeg(str(tmp_path / "root" / "val" / "img0.jpg"), 8, 8, seed=0)  # flat, as distributed
    assert resolve_split_dirs(str(tmp_path / "root"), None)[0] == str(tmp_path / "root" / "train")
    (tmp_path / "packed" / "train").mkdir(parents=True)
    (tmp_path / "packed" / "train" / "part-0000.tar").write_bytes(b"")
    (tmp_path / "packed" / "other").mkdir()
    assert resolve_split_dirs(str(tmp_path / "packed"), str(tmp_path))[0] == str(tmp_path / "packed" / "train")


@pytest.mark.parametrize("prefix", ["", "folder:"])
def test_data_that_is_a_file_is_one_line_naming_it_and_what_data_may_be(tmp_path, prefix):
    write_jpeg(str(tmp_path / "one.jpg"), 8, 8, seed=0)
    with pytest.raises(UserError) as caught:
        resolve_split_dirs(f"{prefix}{tmp_path / 'one.jpg'}", str(tmp_path))
    assert_names(single_line(str(caught.value)), tmp_path / "one.jpg", "a folder", "pattern")
    assert "does not exist" not in str(caught.value)

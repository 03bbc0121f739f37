"""`imagenet-elastic pack`: shards that hold every image (its own bytes, or a resized copy under --max-side) with its
label, that Python's tarfile and the webdataset package open, the same whatever the process count; from class
folders, a flat val folder and Hugging Face parquet files; an interrupted pack is completed by a rerun, and an OUT
that holds anything else is refused."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import REPO, assert_names, child_env, make_image_folder, python_cmd, single_line
from makers import flip_byte_in_place, hub_folder, middle_of_image, relabel_in_place, run_pack, write_jpeg
from PIL import Image

from imagenet_elastic.data import sources
from imagenet_elastic.data.pixels import decode_bytes
from imagenet_elastic.data.sources import tar_shards
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import CorruptImageError, UserError
from imagenet_elastic.tools import pack


def refused(capsys, *argv: str) -> str:
    """`imagenet-elastic pack ARGV` that stops on bad input: exit 2 and the one line it said."""
    with pytest.raises(SystemExit) as stopped:
        pack.main(list(argv))
    said = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(said) == 1, said
    return said[0]


def assert_same_samples(packed: sources.Source, original: sources.Source) -> None:
    assert len(packed) == len(original) and packed.classes == original.classes
    assert packed.labels.tolist() == original.labels.tolist()
    assert all(packed.read(i) == original.read(i) for i in range(len(original)))


@pytest.fixture(scope="module")
def packed(image_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("pack") / "out"
    result = run_pack(str(image_folder), str(out), "--shard-size", "16", "--workers", "2")
    return out, result


def test_a_pack_of_class_folders_holds_every_image_byte_for_byte_with_its_label(image_folder, packed):
    out, result = packed
    assert result["images"] == 96 + 35 and result["resized"] == 0
    assert sorted(os.listdir(out)) == ["classes.txt", "pack.json", "train", "val"]
    assert json.loads((out / "pack.json").read_text())["complete"] is True
    assert sorted(os.listdir(out / "train")) == [tar_shards.INDEX_NAME, *(f"shard-{k:06d}.tar" for k in range(6))]
    train, val = sources.open_splits(str(out), None, None, None)
    assert train.packed and val.packed and "index written by pack" in train.describe()
    original_train, original_val = sources.open_splits(str(image_folder), None, None, None)
    assert_same_samples(train, original_train)
    assert_same_samples(val, original_val)


def test_the_packs_shards_open_with_tarfile_and_with_the_webdataset_package(image_folder, packed):
    out, _ = packed
    original = scan_image_folder(str(image_folder / "train"), "train")
    with tarfile.open(out / "train" / "shard-000000.tar") as tar:
        names = tar.getnames()
    assert names[:4] == ["00000000_train_000_00000.jpg", "00000000_train_000_00000.cls",
                         "00000001_train_000_00001.jpg", "00000001_train_000_00001.cls"]
    samples = list(wds.WebDataset(str(out / "train" / "shard-{000000..000005}.tar"), shardshuffle=False))
    assert [s["jpg"] for s in samples] == [original.read(i) for i in range(len(original))]
    assert [int(s["cls"]) for s in samples] == original.labels.tolist()


def test_the_same_input_packs_to_the_same_bytes_with_any_process_count(image_folder, packed, tmp_path):
    out, _ = packed
    run_pack(str(image_folder), str(tmp_path / "one"), "--shard-size", "16", "--workers", "1")
    for split in ("train", "val"):
        shards = sorted(n for n in os.listdir(out / split) if n.endswith(".tar"))
        assert shards == sorted(n for n in os.listdir(tmp_path / "one" / split) if n.endswith(".tar"))
        for name in shards:
            assert (out / split / name).read_bytes() == (tmp_path / "one" / split / name).read_bytes(), name


def test_max_side_resizes_only_the_larger_images_and_keeps_the_others_bytes(tmp_path):
    """The longer side is capped, whichever it is: `portrait` is narrower than the cap, and taller."""
    src = tmp_path / "src"
    sizes = {"wide": (120, 60), "tall": (50, 90), "portrait": (30, 90), "small": (40, 30)}
    for split in ("train", "val"):
        for k, (name, (w, h)) in enumerate(sizes.items()):
            write_jpeg(str(src / split / "only" / f"{name}.jpg"), w, h, seed=k)
    result = run_pack(str(src), str(tmp_path / "out"), "--max-side", "48", "--quality", "80")
    assert result["resized"] == 6 and result["max_side"] == 48
    train = sources.open_source(str(tmp_path / "out" / "train"), "train", None)
    original = scan_image_folder(str(src / "train"), "train")
    for i in range(len(train)):
        with Image.open(io.BytesIO(train.read(i))) as img:
            name = os.path.basename(original.path(i))[:-4]
            w, h = sizes[name]
            expected = (w, h) if max(w, h) <= 48 else (round(w * 48 / max(w, h)), round(h * 48 / max(w, h)))
            assert img.size == expected and img.format == "JPEG", name
        assert (train.read(i) == original.read(i)) == (name == "small")


def test_a_flat_val_folder_with_its_labels_file_is_packed_as_a_split(image_folder, tmp_path):
    from makers import flatten

    rows = flatten(image_folder, tmp_path / "flat")
    (tmp_path / "labels.csv").write_text("".join(f"{name},{cls}\n" for name, cls in rows))
    run_pack(str(image_folder), str(tmp_path / "out"), "--val-path", str(tmp_path / "flat"), "--val-labels",
             str(tmp_path / "labels.csv"))
    _, val = sources.open_splits(str(tmp_path / "out"), None, None, None)
    _, labelled = sources.open_splits(str(image_folder), str(tmp_path / "flat"), str(tmp_path / "labels.csv"), None)
    assert_same_samples(val, labelled)


def test_an_image_whose_file_name_is_not_utf8_is_packed_under_a_key_that_shows_its_byte(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=2, val_per_class=1)
    odd = sorted((src / "train").rglob("*.jpg"))[1]
    os.rename(odd, os.fsencode(odd.parent) + b"/caf\xff.jpg")
    run_pack(str(src), str(tmp_path / "out"), "--workers", "1")
    with tarfile.open(tmp_path / "out" / "train" / pack.shard_name(0)) as tar:
        assert "00000000_caf_xff.jpg" in tar.getnames()
    assert_same_samples(sources.open_source(str(tmp_path / "out" / "train"), "train", None),
                        scan_image_folder(str(src / "train"), "train"))


def test_bmp_and_tiff_images_are_packed_as_png_of_the_pixels_training_decodes_from_the_folder(tmp_path):
    """A member's extension picks its decoder (webdataset's, the GPU path's nvJPEG for .jpg): a BMP or TIFF kept
    under .jpg would reach a JPEG decoder. Stored as PNG, lossless, of the RGB training makes of the file."""
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=3, val_per_class=1)
    jpegs = sorted((src / "train").rglob("*.jpg"))
    for path, fmt, mode in zip(jpegs, ("BMP", "TIFF", "PNG", "TIFF", "BMP"), ("RGB", "RGBA", "RGB", "L", "P")):
        with Image.open(path) as img:
            img.convert(mode).save(path.with_suffix(f".{fmt.lower()}"), format=fmt)
        path.unlink()
    run_pack(str(src), str(tmp_path / "out"), "--workers", "1")
    with tarfile.open(tmp_path / "out" / "train" / pack.shard_name(0)) as tar:
        images = [name for name in tar.getnames() if not name.endswith(".cls")]
    assert [name.rpartition(".")[2] for name in images] == ["png", "png", "png", "png", "png", "jpg"]
    packed_train = sources.open_source(str(tmp_path / "out" / "train"), "train", None)
    original = scan_image_folder(str(src / "train"), "train")
    assert packed_train.labels.tolist() == original.labels.tolist()
    whole = lambda w, h: ((0, 0, w, h), False)  # noqa: E731
    for i in range(len(original)):
        assert torch.equal(decode_bytes(packed_train.read(i), "packed", whole, 40),
                           decode_bytes(original.read(i), original.path(i), whole, 40)), original.path(i)
    assert packed_train.read(2) == original.read(2) and packed_train.read(5) == original.read(5)  # PNG, JPEG kept


def test_hugging_face_parquet_files_are_packed_through_their_source_with_their_names(image_folder, tmp_path,
                                                                                    capsys):
    hub = hub_folder(image_folder, tmp_path / "imagenet-1k", rows_per_group=7)
    run_pack(str(hub), str(tmp_path / "out"), "--shard-size", "20", "--workers", "2")
    assert "warning" not in capsys.readouterr().err  # not training's, that parquet is slow to train from: pack it
    packed_train, packed_val = sources.open_splits(str(tmp_path / "out"), None, None, None)
    train, val = sources.open_splits(str(image_folder), None, None, None)
    assert_same_samples(packed_train, train)  # row groups of 7 across shards of 20 and two files
    assert_same_samples(packed_val, val)
    assert packed_val.member(0) == "00000000_ILSVRC2012_val_00000001.jpg"  # keyed by the image's own name


def test_parquet_without_pyarrow_names_the_extra_to_install(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    for name in ("train-00000-of-00001.parquet", "validation-00000-of-00001.parquet"):
        (tmp_path / "src" / name).write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=r"needs pyarrow: pip install 'imagenet_elastic\[parquet\]'"):
        pack.pack(str(tmp_path / "src"), str(tmp_path / "out"), pack.build_parser().parse_args(["x", "y"]))
    assert not (tmp_path / "out").exists()


def test_an_out_folder_with_anything_else_in_it_is_refused_and_left_as_it_was(image_folder, packed, tmp_path, capsys):
    out, _ = packed
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for target, message in ((other, f"OUT {other} is not empty (notes.txt ...): choose a new or empty folder"),
                            (out, f"OUT {out} already holds a complete pack of {image_folder}")):
        before = {p: p.stat().st_mtime_ns for p in target.rglob("*")}
        said = refused(capsys, str(image_folder), str(target), "--shard-size", "16")
        assert said == f"imagenet-elastic: error: pack: {message}"
        assert {p: p.stat().st_mtime_ns for p in target.rglob("*")} == before


def test_an_out_whose_pack_json_is_json_but_not_an_object_is_named_as_damaged(image_folder, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / pack.PACK_FILE).write_text("[]")
    said = refused(capsys, str(image_folder), str(out), "--shard-size", "16")
    assert said == f"imagenet-elastic: error: pack: {out / pack.PACK_FILE} is damaged: remove {out} to pack again"


@pytest.mark.parametrize(("src", "out", "split"), [
    ("data", "data/train/pk", "data/train"), ("data", "data/val", "data/val"), ("data/train", "data", "data/train")])
def test_an_out_inside_a_split_it_reads_or_holding_one_is_refused_naming_both_before_anything_is_written(
        tmp_path, capsys, src, out, split):
    make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    listed = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    said = refused(capsys, str(tmp_path / src), str(tmp_path / out), "--val-path", str(tmp_path / "data" / "val"))
    assert_names(said, "OUT", tmp_path / out, tmp_path / split)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == listed


def test_an_interrupted_pack_of_a_source_changed_since_is_refused_saying_what_changed(tmp_path, capsys):
    src, out = make_image_folder(tmp_path / "src", classes=2, train_per_class=2, val_per_class=1), tmp_path / "out"
    run_pack(str(src), str(out), "--shard-size", "2")
    (out / "train" / tar_shards.INDEX_NAME).unlink()  # interrupted before its indexes
    record = json.loads((out / pack.PACK_FILE).read_text())
    (out / pack.PACK_FILE).write_text(json.dumps({**record, "complete": False}))
    shutil.copy(sorted((src / "train").rglob("*.jpg"))[0], src / "train" / "class_000" / "added.jpg")
    listed = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    said = refused(capsys, str(src), str(out), "--shard-size", "2")
    assert_names(said, out, "train", "4", src / "train", "5")
    assert "options" not in said
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == listed


@pytest.mark.parametrize("out", ["file", "file/sub"])
def test_an_out_that_is_a_file_or_under_one_is_bad_input_naming_it_before_writing(image_folder, tmp_path, capsys, out):
    (tmp_path / "file").write_text("mine")
    assert_names(refused(capsys, str(image_folder), str(tmp_path / out)), tmp_path / out)
    assert (tmp_path / "file").read_text() == "mine" and os.listdir(tmp_path) == ["file"]


def interrupted_copy(packed, tmp_path) -> pathlib.Path:
    """A copy of a pack as one killed after its last shard leaves it: no indexes, pack.json unfinished."""
    copy = tmp_path / "pack"
    shutil.copytree(packed[0], copy)
    for split in ("train", "val"):
        (copy / split / tar_shards.INDEX_NAME).unlink()
    record = json.loads((copy / pack.PACK_FILE).read_text())
    (copy / pack.PACK_FILE).write_text(json.dumps({**record, "complete": False}))
    return copy


@pytest.mark.parametrize("name", ["shard-000001 (copy).tar", "shard-1.tar"])
def test_a_continued_pack_refuses_a_shard_it_did_not_name_naming_the_file(image_folder, packed, tmp_path, capsys,
                                                                            name):
    copy = interrupted_copy(packed, tmp_path)
    shutil.copy(copy / "train" / pack.shard_name(1), copy / "train" / name)
    said = refused(capsys, str(image_folder), str(copy), "--shard-size", "16")
    assert_names(said, copy / "train" / name)
    assert (copy / "train" / name).is_file()


@pytest.mark.parametrize("older", [False, True], ids=["real paths", "pack.json with relative paths"])
def test_an_interrupted_pack_is_continued_from_another_directory_or_with_absolute_paths(tmp_path, monkeypatch, older):
    make_image_folder(tmp_path / "src", classes=2, train_per_class=2, val_per_class=1)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    run_pack("src", "out", "--shard-size", "2")
    (tmp_path / "out" / "train" / tar_shards.INDEX_NAME).unlink()  # interrupted before its indexes
    record = json.loads((tmp_path / "out" / pack.PACK_FILE).read_text())
    if older:  # as pack wrote it before it recorded real paths, run here as `pack src out`
        record = {**record, "source": str(tmp_path / "src"),
                  "splits": {role: {**split, "from": f"src/{role}"} for role, split in record["splits"].items()}}
    (tmp_path / "out" / pack.PACK_FILE).write_text(json.dumps({**record, "complete": False}))
    if not older:
        monkeypatch.chdir(tmp_path / "elsewhere")
    assert run_pack(str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "2")["images"] == 0
    assert json.loads((tmp_path / "out" / pack.PACK_FILE).read_text())["splits"]["train"]["from"] == str(
        tmp_path / "src" / "train")


def test_the_command_that_finishes_an_interrupted_pack_has_its_options_and_finishes_it(tmp_path):
    tmp_path = tmp_path / "my data's $HOME"  # pasted into a shell, the command reads back as the same words
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=2, val_per_class=1)
    os.rename(src / "val", tmp_path / "val")
    out = tmp_path / "out"
    options = ("--val-path", str(tmp_path / "val"), "--shard-size", "2", "--quality", "50")
    run_pack(str(src), str(out), *options)
    (out / "train" / tar_shards.INDEX_NAME).unlink()  # interrupted before its indexes
    record = json.loads((out / pack.PACK_FILE).read_text())
    (out / pack.PACK_FILE).write_text(json.dumps({**record, "complete": False}))
    with pytest.raises(UserError) as caught:
        sources.open_source(str(out / "train"), "train", None)
    command = shlex.split(re.search(r"`imagenet-elastic pack ([^`]*)`", str(caught.value)).group(1))
    assert command[:2] == [str(src), str(out)] and all(option in command for option in options), command
    assert run_pack(*command)["images"] == 0
    assert json.loads((out / pack.PACK_FILE).read_text())["complete"]


@pytest.mark.parametrize("name", ["two\nlines", "tab\there", "bell\x07"])
def test_a_class_name_with_a_line_break_or_control_character_is_refused_naming_it_before_writing(tmp_path, capsys,
                                                                                                  name):
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=2, val_per_class=1)
    for split in ("train", "val"):
        os.rename(src / split / "class_001", src / split / name)
    said = refused(capsys, str(src), str(tmp_path / "out"))
    assert_names(said, repr(name))
    assert not (tmp_path / "out").exists()


def test_class_names_with_leading_or_trailing_spaces_come_back_from_the_pack_as_they_were(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=2, val_per_class=1)
    for split in ("train", "val"):
        os.rename(src / split / "class_000", src / split / " lead")
        os.rename(src / split / "class_001", src / split / "trail ")
    run_pack(str(src), str(tmp_path / "out"))
    (tmp_path / "out" / "train" / tar_shards.INDEX_NAME).unlink()  # classes from classes.txt, not the index
    assert sources.open_source(str(tmp_path / "out" / "train"), "train", None).classes == (" lead", "trail ")


def test_quality_out_of_range_is_refused_in_a_short_line(tmp_path, capsys):
    said = refused(capsys, str(tmp_path), str(tmp_path / "out"), "--quality", "0")
    assert_names(said, "--quality", "1", "0")
    assert len(said) < 100, said


def test_more_workers_than_any_machine_could_hold_are_refused_before_one_starts(tmp_path, capsys):
    said = refused(capsys, str(tmp_path), str(tmp_path / "out"), "--workers", "1000")
    assert_names(said, "--workers", "128", "1000")


def test_a_packs_shard_changed_in_place_at_its_size_is_refused_naming_it_and_the_pack_command(image_folder, packed,
                                                                                              tmp_path, capsys):
    out, _ = packed
    copy = tmp_path / "pack"
    shutil.copytree(out, copy)  # copy2: mtimes kept
    shard = copy / "train" / "shard-000002.tar"
    original = sources.open_source(str(copy / "train"), "train", None).label(35)  # the 4th sample of the 3rd shard
    relabel_in_place(shard, 3, (original + 1) % 4)
    with pytest.raises(UserError) as raised:
        sources.open_splits(str(copy), None, None, None)
    index = copy / "train" / tar_shards.INDEX_NAME
    # the shard, its index, the sample and both labels; the remedies: pack again (its command) or remove the index
    assert_names(single_line(str(raised.value)), shard, index, "sample 3", f"label {(original + 1) % 4}",
                 f"index {original}", f"imagenet-elastic pack {image_folder} NEW_OUT --shard-size 16", index)
    said = refused(capsys, str(copy), str(tmp_path / "again"))  # pack of the changed pack: the same line
    assert said == f"imagenet-elastic: error: {raised.value}"


def test_a_copy_of_a_pack_that_lost_its_mtimes_is_checked_once_by_its_headers_and_kept(packed, tmp_path):
    out, _ = packed
    copy = tmp_path / "pack"
    shutil.copytree(out, copy, copy_function=shutil.copyfile)  # as `cp -r`: new mtimes
    train, val = sources.open_splits(str(copy), None, None, None)
    original, _ = sources.open_splits(str(out), None, None, None)
    assert train.packed and train.fingerprint() == original.fingerprint() and original.notes == ()
    assert_names(train.notes[0], "6", copy / "train", "mtimes", "same members")  # how many, where, what differs
    assert "checksum, compared as it is read" in train.notes[0], train.notes
    assert re.search(r"took \d+\.\d s$", train.notes[0]), train.notes


def test_a_packs_index_keeps_the_crc32_of_every_image_it_holds(image_folder, packed):
    out, _ = packed
    train = sources.open_source(str(out / "train"), "train", None)
    folder = scan_image_folder(str(image_folder / "train"), "train")
    assert train.checksums.tolist() == [zlib.crc32(folder.read(i)) for i in range(len(folder))]


def test_a_byte_changed_in_place_inside_a_packed_image_stops_its_read_naming_shard_member_and_the_pack_command(
        image_folder, packed, tmp_path):
    """The issue's case: headers and sizes as packed, a new mtime; the start notes it without calling it a copy,
    and the read of that sample, whoever reads it, is refused before its bytes go anywhere."""
    out, _ = packed
    copy = tmp_path / "pack"
    shutil.copytree(out, copy)  # copy2: mtimes kept
    clean = sources.open_source(str(copy / "train"), "train", None)
    shard = copy / "train" / "shard-000002.tar"
    flip_byte_in_place(shard, middle_of_image(clean, 35))  # the 4th sample of the 3rd shard
    train, _ = sources.open_splits(str(copy), None, None, None)
    assert len(train.notes) == 1 and train.notes[0].startswith(f"1 shards of {copy / 'train'} have other mtimes")
    assert all(train.read(i) == clean.read(i) for i in range(len(train)) if i != 35)
    with pytest.raises(CorruptImageError) as raised:
        train.read(35)
    said = str(raised.value)
    assert f"shard {shard} member {train.member(35)} has other bytes" in said, said
    assert f"pack again (imagenet-elastic pack {image_folder} NEW_OUT --shard-size 16)" in said, said
    assert said == refused_pack_of(copy, tmp_path).removeprefix("imagenet-elastic: error: ")  # a pack of it too


def refused_pack_of(src, tmp_path) -> str:
    """The one line `pack SRC` ends with (exit 2)."""
    with pytest.raises(SystemExit) as stopped, contextlib.redirect_stderr(io.StringIO()) as err:
        pack.main([str(src), str(tmp_path / "again"), "--workers", "1"])
    lines = [line for line in err.getvalue().splitlines() if not line.startswith("warning: ")]
    assert stopped.value.code == 2 and len(lines) == 1, err.getvalue()
    return lines[0]


def test_a_pack_index_from_before_checksums_reads_as_it_is_and_says_what_it_cannot_tell(packed, tmp_path):
    out, _ = packed
    copy = tmp_path / "pack"
    shutil.copytree(out, copy)
    folder = copy / "train"
    clean = sources.open_source(str(folder), "train", None)
    tar_shards.write_index(replace(clean, checksums=None), str(folder / tar_shards.INDEX_NAME), relative_to=str(folder))
    assert "checksums" not in np.load(folder / tar_shards.INDEX_NAME).files
    old = sources.open_source(str(folder), "train", None)
    assert old.checksums is None and old.notes == ()
    assert old.describe().endswith("(index written by pack, no checksums)")
    packed_bytes = clean.read(3)
    flip_byte_in_place(folder / "shard-000000.tar", middle_of_image(clean, 3), keep_mtime=True)
    assert old.read(3) != packed_bytes and len(old.read(3)) == len(packed_bytes)  # unverified: read as it is
    flip_byte_in_place(folder / "shard-000000.tar", middle_of_image(clean, 3))  # back, a new mtime
    touched = sources.open_source(str(folder), "train", None)
    assert touched.notes[0].startswith(f"1 shards of {folder} have other mtimes") and "no checksums" in touched.notes[0]


def test_an_interrupted_packs_rerun_keeps_the_checksums_of_the_shards_it_kept(image_folder, packed, tmp_path):
    out, copy = packed[0], interrupted_copy(packed, tmp_path)
    assert run_pack(str(image_folder), str(copy), "--shard-size", "16")["images"] == 0  # every shard kept
    for split in ("train", "val"):
        assert (sources.open_source(str(copy / split), split, None).checksums.tolist()
                == sources.open_source(str(out / split), split, None).checksums.tolist())


# os.register_at_fork cannot be undone: the hook records only while a test holds this list
_threads_at_fork: list[list[int]] = []
os.register_at_fork(before=lambda: [seen.append(threading.active_count()) for seen in _threads_at_fork])


def test_the_pool_forks_before_the_progress_bar_starts_a_thread(image_folder, tmp_path, monkeypatch):
    """On a terminal the bar is rich's, which refreshes from a thread of its own; a fork while that thread (or the
    pool's own) runs Python can leave its locks (stdout's) held for ever in the pool's processes (CPython
    gh-112275)."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    before, seen = threading.active_count(), []
    _threads_at_fork.append(seen)
    try:
        pack.main([str(image_folder), str(tmp_path / "out"), "--shard-size", "16", "--workers", "2"])
    finally:
        _threads_at_fork.remove(seen)
    assert "packing" in sys.stdout.getvalue()  # the bar was drawn
    assert seen == [before, before]  # two workers, each forked with no thread of the pack's running


def test_a_corrupt_image_is_named_and_leaves_no_index(tmp_path, capsys):
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=3, val_per_class=1)
    bad = sorted((src / "train").rglob("*.jpg"))[2]
    bad.write_bytes(b"\xff\xd8\xff garbage")
    said = refused(capsys, str(src), str(tmp_path / "out"), "--workers", "2")
    assert said.startswith(f"imagenet-elastic: error: pack: cannot decode image {bad}: "), said
    assert "object at 0x" not in said  # Pillow's name for the buffer it read, not the file's
    assert not (tmp_path / "out" / "train" / tar_shards.INDEX_NAME).exists()
    assert json.loads((tmp_path / "out" / "pack.json").read_text())["complete"] is False


@pytest.mark.parametrize("options", [[], ["--max-side", "64"]], ids=["every byte kept", "smaller than max-side"])
def test_an_image_cut_short_is_refused_by_name_though_its_header_reads(tmp_path, capsys, options):
    """A JPEG whose header is whole but whose data ends early: copied as it is, training would meet it; the pack
    decodes every image it keeps and refuses this one, naming it, with no index written."""
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=3, val_per_class=1)
    bad = sorted((src / "train").rglob("*.jpg"))[4]
    raw = bad.read_bytes()
    bad.write_bytes(raw[:len(raw) // 2])
    with Image.open(bad) as img:
        assert img.size == (48, 40)  # the header still reads
    said = refused(capsys, str(src), str(tmp_path / "out"), "--workers", "1", *options)
    assert said.startswith("imagenet-elastic: error: "), said
    assert_names(said, "pack", bad, "image file is truncated")  # the command, the image, the decoder's error
    assert not (tmp_path / "out" / "train" / tar_shards.INDEX_NAME).exists()


@pytest.mark.slow
def test_a_pack_killed_midway_is_completed_by_a_rerun_to_the_same_bytes(tmp_path):
    """SIGKILL once the first shards exist: the rerun keeps them, removes the temp file of the shard in flight,
    writes the rest, and ends with the shards an uninterrupted pack writes."""
    src = make_image_folder(tmp_path / "src", classes=4, train_per_class=60, val_per_class=5)
    args = ["pack", str(src), str(tmp_path / "out"), "--shard-size", "8", "--max-side", "32", "--workers", "1"]
    proc = subprocess.Popen(python_cmd(*args), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "out" / "train" / "shard-000003.tar").exists():
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = sorted(os.listdir(tmp_path / "out" / "train"))
    assert "shard-000003.tar" in left and tar_shards.INDEX_NAME not in left, left
    again = subprocess.run(python_cmd(*args), cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["images"] < 240 + 20  # the kept shards not again
    whole = subprocess.run(python_cmd("pack", str(src), str(tmp_path / "whole"), *args[3:]), cwd=REPO,
                           env=child_env(), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    for split in ("train", "val"):
        names = sorted(n for n in os.listdir(tmp_path / "whole" / split) if n.endswith(".tar"))
        assert names == sorted(n for n in os.listdir(tmp_path / "out" / split) if not n.endswith(".npz"))
        for name in names:
            assert (tmp_path / "out" / split / name).read_bytes() == (tmp_path / "whole" / split / name).read_bytes()
    index = np.load(tmp_path / "out" / "train" / tar_shards.INDEX_NAME)
    assert len(index["labels"]) == 240
    shutil.rmtree(tmp_path / "whole")


@contextlib.contextmanager
def held_pack(tmp_path, src, *options: str, hold_from: int) -> Iterator[tuple[subprocess.Popen, pathlib.Path]]:
    """`imagenet-elastic pack SRC OUT --workers 2 OPTIONS` in its own process group, its workers held in each training
    shard from sample `hold_from` on (tests/pack_held.py) for ten minutes; the group killed on the way out."""
    holding = tmp_path / "holding"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "pack_held.py"), "pack", str(src),
                             str(tmp_path / "out"), "--workers", "2", *options], cwd=REPO,
                            env=child_env(PACK_HOLD_FROM=str(hold_from), PACK_HOLDING=str(holding), PACK_HOLD_S="600",
                                          PYTHONFAULTHANDLER="1"),  # SIGABRT: every thread's stack (ended())
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield proc, holding
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ended(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The stderr of `proc` once it exits; a process still there after `timeout` s fails the test with the stack of
    each of its threads (faulthandler's, on SIGABRT)."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGABRT)
        pytest.fail(f"still running {timeout:g} s after the signal; its threads:\n{proc.communicate(timeout=30)[1]}")


def holders(holding: pathlib.Path, count: int, proc: subprocess.Popen) -> list[int]:
    """The pids of the first `count` workers that hold, once they do."""
    deadline = time.monotonic() + 120
    while (time.monotonic() < deadline and proc.poll() is None
           and len(holding.read_text().splitlines() if holding.exists() else []) < count):
        time.sleep(0.01)
    lines = holding.read_text().splitlines() if holding.exists() else []
    assert len(lines) >= count, (proc.poll(), lines)
    return [int(line.split()[0]) for line in lines[:count]]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_ctrl_c_during_a_pack_says_one_line_exits_130_and_the_rerun_completes_it(tmp_path):
    """SIGINT to the process group, as a terminal's Ctrl-C sends it to the parent and its pool's workers alike, while
    both workers are writing a shard (held there by tests/pack_held.py until the signal, the first four shards
    complete): one line and exit 130 (no traceback from the parent or any worker), the two shards in flight left as
    temporary files, no index; the same command then writes every shard but the first four."""
    src = make_image_folder(tmp_path / "src", classes=4, train_per_class=60, val_per_class=5)
    options = ["--shard-size", "8", "--max-side", "32"]
    with held_pack(tmp_path, src, *options, hold_from=32) as (proc, holding):
        holders(holding, 2, proc)
        os.killpg(proc.pid, signal.SIGINT)
        err = ended(proc)
    said = err.strip().splitlines()
    assert proc.returncode == 130 and len(said) == 1, err
    assert said[0].startswith("imagenet-elastic: ") and not said[0].startswith("imagenet-elastic: error: "), said
    assert_names(said[0], "pack", "interrupted", "the same command", tmp_path / "out")  # what to run, what it keeps
    left = sorted(os.listdir(tmp_path / "out" / "train"))
    assert [name.split(".tar")[0] for name in left] == [".tmp-shard-000004", ".tmp-shard-000005", *(
        f"shard-{k:06d}" for k in range(4))], left
    result = run_pack(str(src), str(tmp_path / "out"), *options, "--workers", "2")
    assert result["images"] == 240 + 20 - 4 * 8  # the four complete shards kept
    train, _ = sources.open_splits(str(tmp_path / "out"), None, None, None)
    assert len(train) == 240 and train.packed
    assert not [name for name in os.listdir(tmp_path / "out" / "train") if name.startswith(".tmp")]


def sleeping_shard_task(*_task) -> None:  # a pool worker's task that writes nothing for half a minute
    time.sleep(30)


def test_a_ctrl_c_while_the_pool_writes_is_raised_between_two_waits_and_the_pool_ends_at_once(monkeypatch):
    """Raised wherever the signal came, a KeyboardInterrupt could leave one of concurrent.futures' locks held (a
    future's, taken one by one in wait() and as_completed()), and the pool's thread or this one would hang on it for
    ever at the stop: the pack's Ctrl-C is raised by the pool's own loop, between two waits."""
    monkeypatch.setattr(pack, "write_shard", sleeping_shard_task)  # the workers are forks: they see it
    before = signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt) as raised, pack.shard_pool(2, [("task", k, None, None) for k in range(4)]) \
            as pool:
        list(pool)
    assert raised.traceback[-1].name == "written"  # the pool's loop, not a lock's wait inside concurrent.futures
    assert time.monotonic() - started < 15 and signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_an_error_in_one_worker_kills_the_other_midway_and_ends_the_pack_at_once(tmp_path):
    """One worker holds in shard 1 (ten minutes) while the other meets a corrupt image at the start of shard 2: the
    pack stops with the one line naming it, without waiting for the held worker, which it kills (its shard stays a
    temporary file). multiprocessing.Pool's terminate() could hang for ever here (CPython gh-96995)."""
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=12, val_per_class=1)
    bad = sorted((src / "train").rglob("*.jpg"))[16]
    bad.write_bytes(b"\xff\xd8\xff garbage")
    with held_pack(tmp_path, src, "--shard-size", "8", hold_from=8) as (proc, holding):
        held = holders(holding, 1, proc)
        err = ended(proc)
    said = err.strip().splitlines()
    assert proc.returncode == 2 and len(said) == 1, err
    assert said[0].startswith(f"imagenet-elastic: error: pack: cannot decode image {bad}: "), said
    assert not alive(held[0])
    left = sorted(os.listdir(tmp_path / "out" / "train"))
    assert [name.split(".tar")[0] for name in left] == [".tmp-shard-000001", "shard-000000"], left


@pytest.mark.slow
def test_a_worker_killed_midway_ends_the_pack_with_one_line_not_a_hang(tmp_path):
    """The out-of-memory killer's SIGKILL to one worker while both hold in a shard: the pack says so in one line and
    exits 1, kills the other, and leaves no index (multiprocessing.Pool replaced the dead worker and waited for its
    shard for ever)."""
    src = make_image_folder(tmp_path / "src", classes=2, train_per_class=12, val_per_class=1)
    with held_pack(tmp_path, src, "--shard-size", "8", hold_from=0) as (proc, holding):
        held = holders(holding, 2, proc)
        os.kill(held[0], signal.SIGKILL)
        err = ended(proc)
    said = err.strip().splitlines()
    assert proc.returncode == 1 and len(said) == 1, err
    assert said[0].startswith("imagenet-elastic: error: "), said
    # what died and the likely why; the remedy (the same command) and where the complete shards are kept
    assert_names(said[0], "pack", "died", "out of memory", "the same command", tmp_path / "out")
    assert not alive(held[1])
    assert tar_shards.INDEX_NAME not in os.listdir(tmp_path / "out" / "train")

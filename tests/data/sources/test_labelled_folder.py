"""A flat validation folder with a labels file (sources/image_folder.py): ImageNet's own layout, a plain CSV or
Kaggle's LOC_val_solution.csv, and every mistake in the labels file named by its line."""

from __future__ import annotations

import pytest
from conftest import assert_names, single_line
from makers import flatten, make_split

from imagenet_elastic.data import sources
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import UserError


@pytest.fixture
def flat(image_folder, tmp_path):
    return tmp_path / "flat", flatten(image_folder, tmp_path / "flat")


def test_a_csv_of_files_and_classes_gives_the_same_samples_as_class_folders(image_folder, flat, tmp_path):
    folder, rows = flat
    labels = tmp_path / "labels.csv"
    labels.write_text("filename,class\n" + "".join(f"{name},{cls}\n" for name, cls in reversed(rows)))
    train, val = sources.open_splits(str(image_folder), str(folder), str(labels), None)
    by_class = scan_image_folder(str(image_folder / "val"), "val")
    assert val.classes == train.classes and len(val) == len(by_class) == 35
    assert [val.read(i) for i in range(len(val))] == [by_class.read(i) for i in range(len(by_class))]
    assert val.labels.tolist() == by_class.labels.tolist()
    assert f"labels from {labels}" in val.describe()


def test_imagenets_loc_val_solution_names_files_without_their_extension(image_folder, flat, tmp_path):
    folder, rows = flat
    labels = tmp_path / "LOC_val_solution.csv"
    labels.write_text("\ufeffImageId,PredictionString\n" + "".join(  # a spreadsheet's byte-order mark, too
        f"{name.rsplit('.', 1)[0]},{cls} 12 30 40 50 {cls} 1 2 3 4 \n" for name, cls in rows))
    _, val = sources.open_splits(str(image_folder), str(folder), str(labels), None)
    assert len(val) == 35 and val.labels.tolist() == [
        scan_image_folder(str(image_folder / "val"), "val").classes.index(cls) for _, cls in rows]


@pytest.mark.parametrize(("text", "message"), [
    ("ILSVRC2012_val_00000001.JPEG,class_000\nmissing.JPEG,class_001\n", "line 2: missing.JPEG is not in {folder}"),
    ("ILSVRC2012_val_00000001.JPEG,n99999999\n",
     "line 1: class 'n99999999' of ILSVRC2012_val_00000001.JPEG is not a class of the training split (4 classes, from "
     "'class_000' to 'class_003')"),
    ("a.JPEG\n", "line 1: expected `filename,class`, got 'a.JPEG'"),
    ("ILSVRC2012_val_00000001,class_000\nILSVRC2012_val_00000001.JPEG,class_000\n",
     "line 2: ILSVRC2012_val_00000001.JPEG is listed twice"),
    ("filename,class\n", "lists no images"),
])
def test_a_mistake_in_the_labels_file_is_named_by_its_line(image_folder, flat, tmp_path, text, message):
    folder, _ = flat
    labels = tmp_path / "labels.csv"
    labels.write_text(text)
    with pytest.raises(UserError) as caught:
        sources.open_splits(str(image_folder), str(folder), str(labels), None)
    assert str(caught.value) == f"--val-labels {labels} {message.format(folder=folder)}"


@pytest.mark.parametrize("left_out", [1, 7, 35], ids=["the first image", "one in the middle", "the last image"])
def test_a_labels_file_that_leaves_an_image_of_the_folder_out_names_it(image_folder, flat, tmp_path, left_out):
    folder, rows = flat
    (folder / "README.txt").write_text("not an image: not listed")
    unlisted = f"ILSVRC2012_val_{left_out:08d}.JPEG"
    labels = tmp_path / "labels.csv"
    labels.write_text("".join(f"{name},{cls}\n" for name, cls in rows if name != unlisted))
    with pytest.raises(UserError) as caught:
        sources.open_splits(str(image_folder), str(folder), str(labels), None)
    # the flag and its file, how many of how many images, the folder, the first image left out
    assert_names(single_line(str(caught.value)), "--val-labels", labels, "1", "35", folder, unlisted)


def test_a_labels_file_that_leaves_several_images_out_names_the_first_and_counts_them(image_folder, flat, tmp_path):
    folder, rows = flat
    labels = tmp_path / "labels.csv"
    labels.write_text("".join(f"{name},{cls}\n" for name, cls in rows[3:-2]))
    with pytest.raises(UserError) as caught:
        sources.open_splits(str(image_folder), str(folder), str(labels), None)
    assert_names(single_line(str(caught.value)), "--val-labels", labels, "5", "35", folder,
                 "ILSVRC2012_val_00000001.JPEG")


def test_a_labels_file_that_does_not_exist_is_named(image_folder, flat, tmp_path):
    folder, _ = flat
    with pytest.raises(UserError, match=rf"^--val-labels {tmp_path / 'nope.csv'} does not exist$"):
        sources.open_splits(str(image_folder), str(folder), str(tmp_path / "nope.csv"), None)


def test_a_hidden_file_in_the_flat_folder_needs_no_label(image_folder, flat, tmp_path):
    folder, rows = flat
    (folder / f"._{rows[0][0]}").write_bytes(b"\x00\x05\x16\x07 AppleDouble, not a JPEG")  # macOS's, beside each image
    labels = tmp_path / "labels.csv"
    labels.write_text("".join(f"{name},{cls}\n" for name, cls in rows))
    _, val = sources.open_splits(str(image_folder), str(folder), str(labels), None)
    assert len(val) == len(rows) == 35


def class_names_with_spaces(tmp_path):
    """Class folders named with a space, and a flat val folder of one image of each."""
    make_split(tmp_path / "train", {"golden retriever": 2, "tabby cat": 2})
    (tmp_path / "flat").mkdir()
    for name in ("golden retriever", "tabby cat"):
        first = sorted((tmp_path / "train" / name).iterdir())[0]
        (tmp_path / "flat" / f"{name.split()[0]}.jpg").write_bytes(first.read_bytes())
    return tmp_path / "train", tmp_path / "flat"


def test_a_quoted_class_name_with_a_space_is_the_whole_name_not_its_first_word(tmp_path):
    train, folder = class_names_with_spaces(tmp_path)
    labels = tmp_path / "labels.csv"
    labels.write_text('filename,class\ngolden.jpg,"golden retriever"\ntabby.jpg,tabby cat\n')
    _, val = sources.open_splits(str(train), str(folder), str(labels), None)
    assert val.labels.tolist() == [0, 1]


@pytest.mark.parametrize("header", ["file_name,label", "img,synset", "fname,category"])
def test_a_header_line_of_any_words_that_name_no_file_and_no_class_is_skipped(image_folder, flat, tmp_path, header):
    folder, rows = flat
    labels = tmp_path / "labels.csv"
    labels.write_text(f"{header}\n" + "".join(f"{name},{cls}\n" for name, cls in rows))
    _, val = sources.open_splits(str(image_folder), str(folder), str(labels), None)
    assert len(val) == len(rows) == 35

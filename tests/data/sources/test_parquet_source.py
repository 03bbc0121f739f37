"""Parquet files as a source (sources/parquet.py), and a source named by its prefix (sources.kind_of): Hugging Face's
imagenet-1k files are read in place, any sample at any index, one row group at a time; a folder of them is split by
name; bad files are one line naming them; `parquet:`, `wds:` and `folder:` name a location's kind before the file
system is asked."""

from __future__ import annotations

import os
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import assert_names, single_line
from inprocess import command
from makers import hub_folder, wds_shards, write_parquet

from imagenet_elastic.data import sources
from imagenet_elastic.data.sources import parquet, tar_shards
from imagenet_elastic.errors import UserError


@pytest.fixture(scope="module")
def hub(image_folder, tmp_path_factory):
    return hub_folder(image_folder, tmp_path_factory.mktemp("hub") / "imagenet-1k")


def test_a_folder_of_hub_parquet_files_is_both_splits_read_in_place_at_any_index(image_folder, hub):
    train, val = sources.open_splits(str(hub), None, None, None)
    folder_train, folder_val = sources.open_splits(str(image_folder), None, None, None)
    assert isinstance(train, parquet.ParquetFiles) and [os.path.basename(p) for p in train.files] == [
        "train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]  # not the test split
    for ours, folder in ((train, folder_train), (val, folder_val)):
        assert ours.classes == folder.classes and ours.labels.tolist() == folder.labels.tolist()
        order = list(range(len(folder)))
        random.Random(0).shuffle(order)
        assert all(ours.read(i) == folder.read(i) for i in order)
    assert train.name(50) == f"{train.files[1]}:2:img2.JPEG"  # 48 rows in the first file
    assert val.name(0).endswith("validation-00000-of-00001.parquet:0:ILSVRC2012_val_00000001.JPEG")
    assert train.fingerprint() == sources.open_source(str(hub), "train", None).fingerprint()
    (note,) = train.notes  # one note for training: a row group read per sample (its mean size), and the remedy
    assert_names(single_line(note), "row group", "7", "`imagenet-elastic pack`")
    assert val.notes == ()
    assert len(set(train.entries().tolist())) == len(train)


def test_reading_keeps_one_row_group_and_reads_each_once_in_order(hub, monkeypatch):
    """A loader worker's memory: one row group at a time, never a whole file; in order, each group is read once."""
    source = sources.open_source(str(hub / "data" / "train-*.parquet"), "train", None)
    groups: list[tuple[int, tuple]] = []
    whole_files: list[str] = []
    read_row_group, read = pq.ParquetFile.read_row_group, pq.ParquetFile.read

    def counted_group(self, i, columns=None, **kwargs):
        groups.append((i, tuple(columns)))
        return read_row_group(self, i, columns=columns, **kwargs)

    def counted_read(self, *args, **kwargs):
        whole_files.append("read")
        return read(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted_group)
    monkeypatch.setattr(pq.ParquetFile, "read", counted_read)
    parquet._KEPT.clear()
    for i in range(len(source)):
        source.read(i)
        source.name(i)
    assert len(groups) == len(source.starts) - 1 == 2 * 7  # 48 rows a file in groups of 7: 7 groups each
    assert {columns for _, columns in groups} == {("image",)} and not whole_files
    assert list(parquet._KEPT) == [(source.files[1], 6)]  # the last group read, and only it, kept


def test_a_forked_worker_opens_its_own_files_and_keeps_its_own_row_group(hub):
    source = sources.open_source(str(hub / "data" / "train-*.parquet"), "train", None)
    first = source.read(0)
    pid = os.fork()  # as a loader worker is made
    if pid == 0:
        fresh = not parquet._OPEN and not parquet._KEPT
        os._exit(0 if fresh and source.read(0) == first and len(parquet._OPEN) == 1 else 1)
    assert os.waitpid(pid, 0)[1] == 0 and parquet._OPEN and parquet._KEPT


def test_without_pyarrow_the_trainer_says_which_extra_to_install(hub, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    finished = command([str(hub), "--checkpoints-path", str(tmp_path / "ckpt"), "--device", "cpu"])
    assert finished.returncode == 2
    line = single_line(finished.stderr)
    assert line.startswith("imagenet-elastic: error: ")
    assert_names(line, "pyarrow", "pip install 'imagenet_elastic[parquet]'")  # the package, and the extra to install


def test_a_folder_with_only_training_files_names_the_missing_validation_split(image_folder, tmp_path):
    train, _ = sources.open_splits(str(image_folder), None, None, None)
    (tmp_path / "hf").mkdir()
    write_parquet(tmp_path / "hf" / "train-00000-of-00001.parquet", [train.read(0)], [0], train.classes, 1)
    with pytest.raises(UserError) as caught:
        sources.open_splits(str(tmp_path / "hf"), None, None, None)
    assert_names(str(caught.value), tmp_path / "hf", "val", "validation-*.parquet", "val-*.parquet")


@pytest.mark.parametrize(("name", "split"), [
    ("train-00000-of-00002.parquet", "train"), ("imagenet-1k-train-00000.parquet", "train"),
    ("imagenet-1k-validation-00000.parquet", "val"), ("x_valid_0.parquet", "val"), ("val.parquet", "val"),
    ("imagenet-1k-test-00000.parquet", None), ("trainer-0.parquet", None), ("interval-0.parquet", None)])
def test_a_files_split_is_a_dash_or_underscore_separated_part_of_its_name(name, split):
    assert parquet.split_of(f"/d/{name}") == split


def test_files_named_with_a_prefix_before_the_split_word_are_split_by_it(hub, tmp_path):
    folder = tmp_path / "prefixed"
    folder.mkdir()
    for name in ("train-00000-of-00002", "train-00001-of-00002", "validation-00000-of-00001"):
        os.link(hub / "data" / f"{name}.parquet", folder / f"imagenet-1k-{name}.parquet")
    train, val = sources.open_splits(str(folder), None, None, None)
    assert [os.path.basename(f) for f in val.files] == ["imagenet-1k-validation-00000-of-00001.parquet"]
    assert len(train.files) == 2


def test_a_partial_download_is_refused_naming_its_first_missing_file_and_a_chosen_pattern_is_not(hub, tmp_path):
    folder = tmp_path / "partial"
    folder.mkdir()
    for name in ("train-00000-of-00002", "validation-00000-of-00001"):
        os.link(hub / "data" / f"{name}.parquet", folder / f"{name}.parquet")
    with pytest.raises(UserError) as caught:
        sources.open_splits(str(folder), None, None, None)
    assert_names(single_line(str(caught.value)), "train", folder / "train-00001-of-00002.parquet", "missing")
    train = sources.open_source(str(folder / "train-*.parquet"), "train", None)
    assert len(train.files) == 1


def test_a_training_split_holding_the_validation_files_is_refused_naming_one(hub, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name, new in (("train-00000-of-00002", "a-0"), ("train-00001-of-00002", "a-1"),
                      ("validation-00000-of-00001", "b-0")):
        os.link(hub / "data" / f"{name}.parquet", folder / f"{new}.parquet")
    with pytest.raises(UserError) as caught:
        sources.open_splits(str(folder), str(folder / "b-*.parquet"), None, None)
    assert_names(single_line(str(caught.value)), "train", folder / "b-0.parquet")
    same = sources.open_splits(str(folder / "b-0.parquet"), str(folder / "b-*.parquet"), None, None)
    assert len(same[0]) == len(same[1])  # the very same files, meant


@pytest.mark.parametrize(("columns", "message"), [
    ({"label": [0]}, r"has no column 'image' \(imagenet-1k's rows are image\{bytes,path\} and label\)"),
    ({"image": [b"x"], "label": ["a"]}, r"column image is binary and label is string"),
    ({"image": [b"x"], "label": [7]}, r"label 7 of row 0 is out of range"),
    ({"image": [b"x"], "label": pa.array([None], type=pa.int64())}, r"row 0 has no label"),
])
def test_a_file_that_is_not_imagenets_rows_is_one_line_naming_it(tmp_path, columns, message):
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(UserError, match=message) as raised:
        sources.open_source(str(tmp_path), "train", None, classes=("a", "b"))
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("named", [True, False], ids=["named in the file", "the training split's"])
def test_a_label_equal_to_the_class_count_is_one_line_naming_its_row(image_folder, tmp_path, named):
    """Labels 0..3 of 4 classes are read; a 4 (the first past the end) is refused, by its file and row."""
    train, _ = sources.open_splits(str(image_folder), None, None, None)
    path = tmp_path / "train-00000-of-00001.parquet"
    labels = [0, 1, 2, 3, 3, 2]
    write_parquet(path, [train.read(i) for i in range(len(labels))], labels, train.classes if named else None, 2)
    classes = None if named else train.classes
    assert sources.open_source(str(tmp_path), "train", None, classes=classes).labels.tolist() == labels
    write_parquet(path, [train.read(i) for i in range(len(labels))], [*labels[:4], 4, 2],
                  train.classes if named else None, 2)
    bound = "the files name 4 classes" if named else "the training split has 4 classes"
    with pytest.raises(UserError) as raised:
        sources.open_source(str(tmp_path), "train", None, classes=classes)
    assert str(raised.value) == f"train parquet file {path}: label 4 of row 4 is out of range: {bound}"


def test_a_file_whose_name_is_not_utf8_is_one_line_naming_it_printably(image_folder, tmp_path):
    """pyarrow opens only paths that are UTF-8."""
    train, _ = sources.open_splits(str(image_folder), None, None, None)
    write_parquet(tmp_path / "train-0.parquet", [train.read(0)], [1], train.classes, 1)
    os.rename(tmp_path / "train-0.parquet", os.fsencode(tmp_path) + b"/train-\xff.parquet")
    with pytest.raises(UserError) as caught:
        sources.open_source(str(tmp_path), "train", None)
    assert f"{tmp_path}/train-\\xff.parquet" in str(caught.value)


def test_a_damaged_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "train-00000-of-00001.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UserError) as caught:
        sources.open_source(str(tmp_path), "train", None)
    assert_names(str(caught.value), "train", tmp_path / "train-00000-of-00001.parquet", "not readable")


@pytest.mark.parametrize(("labels", "file", "row", "label"), [
    ([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 99, 2]], 1, 1, 99),  # one stray label past 0..9
    ([[1, 2, 3], [2, 1]], 0, 0, 1),  # numbered from 1
    ([[0, 1, 3], [3, 0]], 0, 2, 3),  # a class in the middle with no row
])
def test_labels_without_class_names_that_skip_a_number_are_refused_naming_the_row(tmp_path, labels, file, row,
                                                                                  label):
    for k, part in enumerate(labels):
        write_parquet(tmp_path / f"train-{k:05d}-of-00002.parquet", [b"x"] * len(part), part, None, 2)
    with pytest.raises(UserError) as raised:
        sources.open_source(str(tmp_path), "train", None)
    line = str(raised.value)
    assert line.startswith(f"train parquet file {tmp_path / f'train-{file:05d}-of-00002.parquet'}: label {label} of "
                           f"row {row} leaves labels ") and "\n" not in line


def test_a_stray_label_without_class_names_stops_the_run_before_it_writes(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_parquet(data / "train-00000-of-00001.parquet", [b"x"] * 11, [*range(10), 99], None, 4)
    write_parquet(data / "validation-00000-of-00001.parquet", [b"x"] * 10, list(range(10)), None, 4)
    finished = command([str(data), "--checkpoints-path", str(tmp_path / "ckpt"), "--device", "cpu",
                        "--global-batch-size", "2", "--workers", "0"])
    assert finished.returncode == 2
    assert len(finished.stderr.strip().splitlines()) == 1 and "Traceback" not in finished.stderr
    # the file, the stray label, its row, the labels it leaves unused
    assert_names(finished.stderr, "train-00000-of-00001.parquet", "99", "10", "10..98")
    assert not (tmp_path / "ckpt").exists()


def test_files_without_class_names_take_the_training_splits(image_folder, tmp_path):
    _, val = sources.open_splits(str(image_folder), None, None, None)
    write_parquet(tmp_path / "val.parquet", [val.read(i) for i in range(len(val))], val.labels.tolist(), None, 10)
    opened = sources.open_source(str(tmp_path / "val.parquet"), "val", None, classes=val.classes)
    assert opened.classes == val.classes and opened.labels.tolist() == val.labels.tolist()
    assert sources.open_source(str(tmp_path / "val.parquet"), "val", None).classes == ("0", "1", "2", "3")


def test_where_counts_one_file_in_the_singular(image_folder, hub):
    one = sources.open_source(str(hub / "data" / "validation-*.parquet"), "val", None)
    two = sources.open_source(str(hub / "data" / "train-*.parquet"), "train", None)
    assert one.where().endswith("(1 parquet file)") and two.where().endswith("(2 parquet files)")


# ----------------------------------------------------------------------------- a kind named by its prefix

def test_a_prefix_names_the_kind_and_every_unprefixed_form_still_opens(image_folder, hub, tmp_path):
    shards = tmp_path / "shards"
    wds_shards(image_folder / "train", shards, per_shard=25)
    for plain, kind in ((str(hub), parquet.ParquetFiles), (str(shards), tar_shards.TarShards),
                        (str(image_folder / "train"), sources.image_folder.ImageFolder)):
        prefixed = sources.open_source(f"{kind_name(kind)}:{plain}", "train", None)
        unprefixed = sources.open_source(plain, "train", None)
        assert type(prefixed) is type(unprefixed) is kind
        assert prefixed.fingerprint() == unprefixed.fingerprint()
    train, val = sources.open_splits(f"parquet:{hub}", None, None, None)
    assert (len(train), len(val)) == (96, 35)
    train, val = sources.open_splits(f"folder:{image_folder}", None, None, None)
    assert train.where() == str(image_folder / "train") and val.where() == str(image_folder / "val")


def kind_name(kind: type) -> str:
    return {parquet.ParquetFiles: "parquet", tar_shards.TarShards: "wds"}.get(kind, "folder")


def test_a_prefix_wins_over_what_the_file_system_shows(image_folder, tmp_path):
    """Shards read as class folders when `folder:` says so: the class-folder reader's own error, not the shards."""
    wds_shards(image_folder / "train", tmp_path / "shards", per_shard=25)
    with pytest.raises(UserError, match=r"has no class folders"):
        sources.open_source(f"folder:{tmp_path / 'shards'}", "train", None)
    with pytest.raises(UserError, match=r"holds no \.parquet files"):
        sources.open_source(f"parquet:{tmp_path / 'shards'}", "train", None)


def test_an_unknown_prefix_or_a_url_is_one_line_naming_the_known_ones(tmp_path, monkeypatch):
    for location in ("hf:ILSVRC/imagenet-1k", "hdfs://namenode/imagenet"):
        with pytest.raises(UserError, match=rf"^no source reads {location}: a location is a path, a path after one of "
                                            r"folder:, parquet:, wds:, or a store's URL \(s3://, gs://, gcs://, "
                                            r"http://, https://\)$"):
            sources.open_source(location, "train", None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run:2" / "train" / "a").mkdir(parents=True)  # a word and a colon that name no kind: a path
    assert sources.train_location("run:2") == os.path.join("run:2", "train")
    assert sources.kind_of("run:2") == (None, "run:2")

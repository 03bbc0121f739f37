"""Tar shards as a source (sources/tar_shards.py): shards written by the `webdataset` package's own writer are
read sample by sample at any index, with no open per sample; the index is kept and re-used; every damaged or
incomplete input is one line naming the shard and the sample."""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
import random
import shutil
import sys
import tarfile
import time
import zlib

import numpy as np
import pytest
from conftest import assert_names, single_line
from makers import flip_byte_in_place, middle_of_image, relabel_in_place, wds_shards

from imagenet_elastic.data import sources
from imagenet_elastic.data.sources import tar_shards
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import CorruptImageError, UserError


@pytest.fixture(scope="module")
def written(image_folder, tmp_path_factory):
    """The fixture's train split as WebDataset shards (5 of 20 samples, one of 16), and the folder itself."""
    out = tmp_path_factory.mktemp("wds") / "train"
    return wds_shards(image_folder / "train", out), scan_image_folder(str(image_folder / "train"), "train")


def test_a_forked_worker_maps_shards_of_its_own_and_the_parent_keeps_its_maps(written):
    shards = tar_shards.open_split(os.path.dirname(written[0][0]), "train", None)
    first = shards.read(0)
    pid = os.fork()  # as a loader worker is made
    if pid == 0:
        os._exit(0 if not tar_shards._MAPS and shards.read(0) == first and len(tar_shards._MAPS) == 1 else 1)
    assert os.waitpid(pid, 0)[1] == 0 and len(tar_shards._MAPS) >= 1


def test_shards_from_webdatasets_writer_give_every_sample_at_any_index(written):
    paths, folder = written
    shards = tar_shards.open_split(os.path.dirname(paths[0]), "train", None)
    assert len(shards) == len(folder) and len(shards.shards) == 5 and not shards.cached
    assert shards.classes == ("0", "1", "2", "3")  # no classes.txt: the labels name them
    order = list(range(len(folder)))
    random.Random(0).shuffle(order)
    for i in order:  # any order: each sample is one slice of its shard's mapping
        assert shards.read(i) == folder.read(i) and shards.label(i) == folder.label(i)
    assert shards.name(21) == f"{paths[1]}:sample00021.jpg"


def test_reading_opens_each_shard_once_per_process_not_once_per_sample(written):
    paths, _ = written
    shards = tar_shards.open_split(os.path.dirname(paths[0]), "train", None)
    tar_shards._MAPS.clear()
    opened: list[str] = []

    def hook(event, args):
        if event == "open" and str(args[0]).endswith(".tar"):
            opened.append(str(args[0]))
    sys.addaudithook(hook)  # stays for the process: it only records .tar opens
    for _ in range(3):
        for i in range(len(shards)):
            shards.read(i)
    assert sorted(opened) == paths  # 288 reads, 5 opens


def test_a_brace_pattern_or_a_glob_names_the_same_shards_in_order(written):
    paths, _ = written
    folder = os.path.dirname(paths[0])
    braced = tar_shards.open_split(os.path.join(folder, "part-{0000..0004}.tar"), "train", None)
    globbed = tar_shards.open_split(os.path.join(folder, "part-*.tar"), "train", None)
    listed = tar_shards.open_split(os.path.join(folder, "part-{0000,0001,0002,0003,0004}.tar"), "train", None)
    for source in (braced, globbed, listed):
        assert list(source.shards) == paths and source.fingerprint() == tar_shards.open_split(folder, "train", None)\
            .fingerprint()
    with pytest.raises(UserError, match=r"train shard .*part-0005\.tar does not exist"):
        tar_shards.open_split(os.path.join(folder, "part-{0000..0005}.tar"), "train", None)


@pytest.mark.parametrize(("split", "listings"), [("", 2), ("part-*.tar", 1)])
def test_a_split_walked_at_its_first_start_is_listed_once_for_its_shards(written, monkeypatch, split, listings):
    """A folder is listed for train and val shards side by side, then for its shards; a pattern globbed once."""
    folder = os.path.dirname(written[0][0])
    listed: list[str] = []

    def recorded(call):
        def listing(path, *args, **kwargs):
            listed.append(str(path))
            return call(path, *args, **kwargs)
        return listing
    monkeypatch.setattr(os, "listdir", recorded(os.listdir))
    monkeypatch.setattr(glob, "glob", recorded(glob.glob))
    assert not tar_shards.open_split(os.path.join(folder, split), "train", None).cached
    assert len(listed) == listings, listed


@pytest.mark.parametrize(("pattern", "expanded"), [
    ("a-{000..003}.tar", ["a-000.tar", "a-001.tar", "a-002.tar", "a-003.tar"]),
    ("{x,y}-{8..10}", ["x-8", "x-9", "x-10", "y-8", "y-9", "y-10"]),
    ("plain.tar", ["plain.tar"]),
])
def test_braces_expand_as_webdatasets_do(pattern, expanded):
    assert tar_shards.expand_braces(pattern) == expanded


@pytest.mark.parametrize(("member", "key", "extension"), [
    ("n01440764_10026.JPEG", "n01440764_10026", "jpeg"), ("dir/k.seg.png", "dir/k", "seg.png"),
    ("a.b/c.cls", "a.b/c", "cls"), ("noext", "noext", "")])
def test_a_members_key_ends_at_the_first_dot_of_its_last_part(member, key, extension):
    assert tar_shards.split_name(member) == (key, extension)


@pytest.fixture
def kept(written, tmp_path):
    """A copy of the shards (tmp_path/shards), opened once and its index kept in the checkpoints folder (tmp_path):
    the folder and what that first opening walked."""
    paths, _ = written
    folder = tmp_path / "shards"
    shutil.copytree(os.path.dirname(paths[0]), folder)
    walked = tar_shards.open_split(str(folder), "train", str(tmp_path))
    walked.keep(str(tmp_path))
    return folder, walked


def test_the_index_is_kept_in_the_checkpoints_folder_and_walked_again_when_a_shard_changes(kept, tmp_path):
    folder, walked = kept
    again = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert again.cached and again.fingerprint() == walked.fingerprint()
    assert "index from the cache" in again.describe()
    time.sleep(0.01)
    os.utime(folder / "part-0002.tar")  # rewritten in place, say
    assert not tar_shards.open_split(str(folder), "train", str(tmp_path)).cached


def test_shards_from_elsewhere_get_the_checksum_of_every_image_at_their_first_indexing(kept, written, tmp_path):
    folder, walked = kept
    _, images = written
    assert walked.checksums.tolist() == [zlib.crc32(images.read(i)) for i in range(len(images))]
    again = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert again.cached and again.checksums.tolist() == walked.checksums.tolist()


@pytest.mark.parametrize("mtime", ["kept", "changed"])
def test_a_byte_changed_in_place_in_a_shard_from_elsewhere_stops_its_read_naming_shard_member_and_the_cache(
        kept, tmp_path, mtime):
    folder, walked = kept
    shard = folder / "part-0002.tar"
    flip_byte_in_place(shard, middle_of_image(walked, 43), keep_mtime=mtime == "kept")  # the 4th of the 3rd shard
    source = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert source.notes == () and source.read(42) == walked.read(42) and source.read(44) == walked.read(44)
    with pytest.raises(CorruptImageError) as raised:
        source.read(43)
    said = str(raised.value)
    assert f"shard {shard} member sample00043.jpg " in said, said
    assert f"remove {tmp_path / 'index-train-shards.npz'} to index the shards again" in said, said


def test_an_index_rebuilt_after_a_shard_from_elsewhere_changed_keeps_every_samples_checksum(kept, tmp_path):
    folder, walked = kept
    relabel_in_place(folder / "part-0002.tar", 3, (walked.label(43) + 1) % 4)
    after = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert after.notes and after.checksums is not None
    assert after.checksums.tolist() == tar_shards.walk(str(folder), "train").checksums.tolist()


def test_shards_from_elsewhere_changed_in_place_are_indexed_again_with_a_note_naming_the_shard(kept, tmp_path):
    folder, _ = kept
    before = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert before.cached and before.notes == ()
    relabel_in_place(folder / "part-0002.tar", 3, (before.label(43) + 1) % 4)  # sample #43: the 4th of the 3rd
    after = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert after.notes == (f"shard {folder / 'part-0002.tar'} changed since it was indexed: indexed again",)
    assert not after.cached and after.label(43) == (before.label(43) + 1) % 4
    assert after.labels.tolist() == tar_shards.walk(str(folder), "train").labels.tolist()
    after.keep(str(tmp_path))
    again = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert again.cached and again.notes == () and again.fingerprint() == after.fingerprint()


def drop_last_sample(shard) -> None:
    """Write the shard again without its last sample's members: a shard of another size."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    last = members[-1][0].name.split(".")[0]
    time.sleep(0.01)
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            if member.name.split(".")[0] != last:
                tar.addfile(member, io.BytesIO(data))


def test_a_cached_index_of_shards_from_elsewhere_one_of_which_changed_size_is_made_again_with_a_note(kept, tmp_path):
    """Only a pack's index is a promise: a cache of shards from elsewhere follows a shard written again shorter."""
    folder, walked = kept
    size = os.path.getsize(folder / "part-0002.tar")
    drop_last_sample(folder / "part-0002.tar")
    assert os.path.getsize(folder / "part-0002.tar") != size
    after = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert after.notes == (f"shard {folder / 'part-0002.tar'} changed since it was indexed: indexed again",)
    assert not after.cached and len(after) == len(walked) - 1
    assert after.labels.tolist() == tar_shards.walk(str(folder), "train").labels.tolist()


def test_a_shard_from_elsewhere_only_touched_keeps_its_index_and_says_nothing(kept, tmp_path):
    folder, walked = kept
    time.sleep(0.01)
    os.utime(folder / "part-0002.tar")
    touched = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert touched.notes == () and touched.fingerprint() == walked.fingerprint()


def test_the_trainer_warns_what_opening_its_data_noted(written, tmp_path, capsys):
    from imagenet_elastic import cli
    from imagenet_elastic.launch.launchers import DistEnv
    from imagenet_elastic.launch.preemption import PreemptionFlag
    from imagenet_elastic.report.console import Console
    from imagenet_elastic.train import build

    paths, _ = written
    for split in ("train", "val"):
        shutil.copytree(os.path.dirname(paths[0]), tmp_path / "data" / split)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    train, val = sources.open_splits(str(tmp_path / "data"), None, None, str(ckpt))
    train.keep(str(ckpt))
    val.keep(str(ckpt))
    relabel_in_place(tmp_path / "data" / "val" / "part-0000.tar", 0, 3)
    config, _ = cli.parse([str(tmp_path / "data"), "--model", "test_resnet", "--checkpoints-path", str(ckpt),
                           "--device", "cpu"])
    with contextlib.ExitStack() as stack:
        inputs, _ = build.check_inputs(build.Run(config, DistEnv(), Console(True), PreemptionFlag(())), stack)
    assert inputs.val.label(0) == 3
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"warning: shard {tmp_path / 'data' / 'val' / 'part-0000.tar'} changed since it was indexed: "
                    "indexed again"]


def test_classes_txt_names_the_classes_and_bounds_the_labels(written, tmp_path):
    paths, _ = written
    folder = tmp_path / "named" / "train"
    shutil.copytree(os.path.dirname(paths[0]), folder)
    (tmp_path / "named" / "classes.txt").write_text("ant\nbee\ncat\ndog\n")
    assert tar_shards.open_split(str(folder), "train", None).classes == ("ant", "bee", "cat", "dog")
    (tmp_path / "named" / "classes.txt").write_text("ant\nbee\ncat\n")
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(folder), "train", None)
    assert_names(str(caught.value), "label 3", "sample #", "3 classes")


def test_a_classes_txt_that_is_not_utf8_is_refused_naming_it(written, tmp_path):
    paths, _ = written
    folder = tmp_path / "named" / "train"
    shutil.copytree(os.path.dirname(paths[0]), folder)
    (tmp_path / "named" / "classes.txt").write_bytes(b"ant\nb\xffe\ncat\ndog\n")
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(folder), "train", None)
    assert str(tmp_path / "named" / "classes.txt") in str(caught.value)


def test_shards_and_members_whose_names_are_not_utf8_are_read_fingerprinted_and_named_printably(tmp_path):
    """Names are bytes in a tar header and on Linux: kept as their bytes where they identify a sample, shown with
    \\xff in messages."""
    shard = os.fsencode(tmp_path) + b"/p\xff-0.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT, errors="surrogateescape") as tar:
        for name, data in (("s\udcff.jpg", JPEG), ("s\udcff.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    split = tar_shards.open_split(str(tmp_path), "train", None)
    assert split.read(0) == JPEG
    assert split.entries().tolist() == [b"p\xff-0.tar:s\xff.jpg"]
    assert split.name(0) == f"{tmp_path}/p\\xff-0.tar:s\\xff.jpg"
    assert split.fingerprint() == tar_shards.open_split(str(tmp_path), "train", None).fingerprint()


def write_tar(path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


JPEG = b"\xff\xd8 not decoded here"


@pytest.mark.parametrize(("members", "message"), [
    ([("a.jpg", JPEG), ("a.cls", b"1"), ("b.jpg", JPEG)], "sample b has no label (.cls)"),
    ([("a.cls", b"1"), ("b.jpg", JPEG), ("b.cls", b"0")], "sample a has no image (.jpg, .jpeg, .png, .webp)"),
    ([("a.jpg", JPEG), ("a.cls", b"one")], "the label of sample a (a.cls) is 'one', not an integer"),
    ([("a.txt", b"x")], "holds no samples (KEY.jpg with KEY.cls)"),
    ([("a.x.cls", b"1"), ("a.x.txt", b"x"), ("b.jpg", JPEG), ("b.cls", b"0")],
     "sample a has no image (.jpg, .jpeg, .png, .webp)"),
])
def test_a_sample_without_its_label_or_image_is_named_with_its_shard(tmp_path, members, message):
    write_tar(tmp_path / "s-0.tar", members)
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path), "train", None)
    said = str(caught.value)
    assert said.startswith(f"train shard {tmp_path / 's-0.tar'}") and said.endswith(message) or message in said, said


@pytest.mark.parametrize("members", [
    [("./train/a.b.jpg", b"0"), ("./train/a.b.cls", b"0"), ("./train/c.jpg", b"1"), ("./train/c.cls", b"1"),
     ("./train/d.e.f.png", b"2"), ("./train/d.e.f.cls", b"0")],
    [("k.seg.png", b"mask"), ("k.jpg", b"0"), ("k.cls", b"0"), ("m.1.png", b"1"), ("m.cls", b"1"), ("n.png", b"2"),
     ("n.x.cls", b"0")],
])
def test_a_key_with_a_dot_is_a_sample_whose_image_and_label_are_known_by_their_last_extension(tmp_path, members):
    """A tar of `./train/a.b.jpg`: webdataset's key ends at the first dot (`./train/a`), its decoders know `b.jpg` for
    an image by its last part; a member of a whole image extension is preferred (`k.jpg`, not the mask `k.seg.png`)."""
    write_tar(tmp_path / "s-0.tar", members)
    shards = tar_shards.open_split(str(tmp_path), "train", None)
    assert [shards.read(i) for i in range(len(shards))] == [b"0", b"1", b"2"] and shards.labels.tolist() == [0, 1, 0]


def test_webdatasets_writer_given_file_names_as_keys_writes_shards_read_whole(tmp_path):
    """ShardWriter writes `n01440764_0.JPEG.jpg` for the key `n01440764_0.JPEG`: webdataset reads the sample
    `n01440764_0` with `jpeg.jpg` and `jpeg.cls`, and so do we (were: no samples)."""
    import webdataset as wds  # not on every machine: its tests' own import

    with wds.TarWriter(str(tmp_path / "s-0.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"n01440764_{i}.JPEG", "jpg": b"%d" % i, "cls": i % 2})
    shards = tar_shards.open_split(str(tmp_path), "train", None)
    read = [(shards.read(i), int(shards.labels[i])) for i in range(len(shards))]
    assert read == [(s["jpeg.jpg"], int(s["jpeg.cls"])) for s in wds.WebDataset(str(tmp_path / "s-0.tar"),
                                                                                  shardshuffle=False)]
    assert read == [(b"0", 0), (b"1", 1), (b"2", 0)]


@pytest.mark.parametrize("members", [
    [("s0.jpg", JPEG), ("s0.cls", b"0"), ("s0.jpg", JPEG), ("s0.cls", b"1"), ("s1.jpg", JPEG), ("s1.cls", b"0")],
    [("s0.jpg", JPEG), ("s0.JPG", JPEG), ("s0.cls", b"0")],
    [("s0.png", JPEG), ("s0.cls", b"0"), ("s0.cls", b"1")],
])
def test_a_key_repeated_in_consecutive_members_is_refused_naming_shard_and_key(tmp_path, members):
    write_tar(tmp_path / "s-0.tar", members)
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path), "train", None)
    assert_names(single_line(str(caught.value)), tmp_path / "s-0.tar", "s0")


def test_a_repeated_member_that_is_neither_image_nor_label_is_not_read_and_not_refused(tmp_path):
    write_tar(tmp_path / "s-0.tar", [("a.jpg", b"1"), ("a.cls", b"0"), ("a.txt", b"x"), ("a.txt", b"y"),
                                     ("notes.txt", b"x"), ("notes.txt", b"y"), ("b.jpg", b"2"), ("b.cls", b"1")])
    shards = tar_shards.open_split(str(tmp_path), "train", None)
    assert [shards.read(i) for i in range(2)] == [b"1", b"2"] and shards.labels.tolist() == [0, 1]


def test_a_key_repeated_after_another_keys_members_is_another_sample_as_in_webdataset(tmp_path):
    write_tar(tmp_path / "s-0.tar", [("a.jpg", b"1"), ("a.cls", b"0"), ("b.jpg", b"2"), ("b.cls", b"1"),
                                     ("a.jpg", b"3"), ("a.cls", b"1")])
    shards = tar_shards.open_split(str(tmp_path), "train", None)
    assert [shards.read(i) for i in range(3)] == [b"1", b"2", b"3"] and shards.labels.tolist() == [0, 1, 1]


@pytest.mark.parametrize("pattern", ["s-0001.tar", "s-{0000..0001}.tar", "s-*.tar"])
def test_a_shard_path_that_is_a_folder_is_named_as_a_folder(tmp_path, pattern):
    write_tar(tmp_path / "s-0000.tar", [("a.jpg", JPEG), ("a.cls", b"0")])
    (tmp_path / "s-0001.tar").mkdir()
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path / pattern), "train", None)
    assert_names(single_line(str(caught.value)), tmp_path / "s-0001.tar", "folder")


def test_a_truncated_or_corrupt_shard_is_named_with_the_sample_it_breaks_in(written, tmp_path):
    paths, _ = written
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(paths[0], cut / "part-0000.tar")
    data = (cut / "part-0000.tar").read_bytes()
    (cut / "part-0000.tar").write_bytes(data[:len(data) // 3])
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(cut), "train", None)
    said = str(caught.value)
    assert said.startswith(f"train shard {cut / 'part-0000.tar'} is truncated") and "sample sample000" in said, said
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "x.tar").write_bytes(os.urandom(3000))
    with pytest.raises(UserError, match=rf"train shard {garbage / 'x.tar'} is truncated or not a tar file"):
        tar_shards.open_split(str(garbage), "train", None)


def test_a_folder_of_shards_numbered_of_a_count_missing_one_is_refused_naming_it(tmp_path):
    for k in (0, 2):
        write_tar(tmp_path / f"s-{k:03d}-of-003.tar", [("a.jpg", JPEG), ("a.cls", b"0")])
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path), "train", None)
    assert_names(single_line(str(caught.value)), "train", tmp_path / "s-001-of-003.tar", "missing")


@pytest.mark.parametrize("name", ["s.tar", "s.tar.gz"])
def test_a_gzip_compressed_shard_is_named_as_such_as_a_pattern_or_in_a_folder(tmp_path, name):
    plain = tmp_path / "plain.tar"
    write_tar(plain, [("a.jpg", JPEG), ("a.cls", b"0")])
    folder = tmp_path / "split"
    folder.mkdir()
    with gzip.open(folder / name, "wb") as f:
        f.write(plain.read_bytes())
    for location in (folder / name, folder):
        with pytest.raises(UserError) as caught:
            sources.open_source(str(location), "train", None)
        assert_names(single_line(str(caught.value)), folder / name, "gzip-compressed", "gunzip")


def test_a_shard_cut_at_a_members_end_is_refused_as_truncated_not_read_short(tmp_path):
    shard = tmp_path / "s.tar"
    write_tar(shard, [("a.jpg", JPEG), ("a.cls", b"1"), ("b.jpg", JPEG), ("b.cls", b"0")])
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[2].offset  # where b's first header begins: a whole sample a before it
    os.truncate(shard, cut)
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(shard), "train", None)
    assert_names(single_line(str(caught.value)), shard, "truncated", "sample a", cut)


def indexed_copy(written, tmp_path):
    """A copy of the written shards, indexed, with no shard mapped yet: what is done to a file after it was indexed."""
    folder = tmp_path / "s"
    shutil.copytree(os.path.dirname(written[0][0]), folder)
    shards = tar_shards.open_split(str(folder), "train", None)
    tar_shards._MAPS.clear()
    return folder, shards


def test_a_shard_cut_short_after_it_was_indexed_is_an_error_naming_it_not_a_crash(written, tmp_path):
    folder, shards = indexed_copy(written, tmp_path)
    last = len(shards) - 1
    with open(folder / "part-0004.tar", "r+b") as f:
        f.truncate(int(shards.offsets[last]) + 10)
    with pytest.raises(CorruptImageError, match=rf"shard {folder / 'part-0004.tar'} is truncated: sample #{last} "):
        shards.read(last)


def test_a_shard_emptied_after_it_was_indexed_is_named_as_truncated_not_a_crash(written, tmp_path):
    folder, shards = indexed_copy(written, tmp_path)
    os.truncate(folder / "part-0000.tar", 0)
    with pytest.raises(CorruptImageError) as caught:
        shards.read(0)
    assert_names(single_line(str(caught.value)), folder / "part-0000.tar", "truncated")
    assert caught.value.exit_code == 2


def test_a_pack_index_that_no_longer_matches_its_shards_is_refused_with_the_shard(written, tmp_path):
    paths, _ = written
    folder = tmp_path / "packed"
    shutil.copytree(os.path.dirname(paths[0]), folder)
    indexed = tar_shards.open_split(str(folder), "train", None)
    tar_shards.write_index(indexed, str(folder / tar_shards.INDEX_NAME), relative_to=str(folder))
    assert tar_shards.open_split(str(folder), "train", None).packed
    with open(folder / "part-0001.tar", "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(UserError, match=rf"shard {folder / 'part-0001.tar'} has \d+ bytes but its index .* says \d+: "
                                        "the shard was replaced or cut short after it was packed"):
        tar_shards.open_split(str(folder), "train", None)
    os.unlink(folder / "part-0001.tar")
    with pytest.raises(UserError, match="lists other shards than"):
        tar_shards.open_split(str(folder), "train", None)


def test_a_pack_index_listing_its_shards_in_another_order_is_refused_in_one_line(written, tmp_path):
    paths, _ = written
    folder = tmp_path / "packed"
    shutil.copytree(os.path.dirname(paths[0]), folder)
    index = folder / tar_shards.INDEX_NAME
    tar_shards.write_index(tar_shards.open_split(str(folder), "train", None), str(index), relative_to=str(folder))
    with np.load(index) as saved:
        arrays = dict(saved)
    arrays["shards"] = arrays["shards"][::-1]
    np.savez(index, **arrays)
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(folder), "train", None)
    assert_names(str(caught.value), index, "lists the shards of", folder, "in another order", len(paths), "entries")


def test_a_val_split_of_numbered_shards_takes_the_training_splits_class_names(written, tmp_path):
    paths, folder = written
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    for k, path in enumerate(paths[:2]):
        shutil.copy(path, root / "train" / f"part-{k}.tar")
    os.makedirs(root / "val")
    write_tar(root / "val" / "v.tar", [("a.jpg", folder.read(0)), ("a.cls", b"3")])
    (root / "classes.txt").write_text("ant\nbee\ncat\ndog\n")
    train, val = sources.open_splits(str(root), None, None, None)
    assert train.classes == val.classes == ("ant", "bee", "cat", "dog") and val.label(0) == 3
    write_tar(root / "val" / "w.tar", [("b.jpg", folder.read(1)), ("b.cls", b"4"), ("c.jpg", folder.read(2)),
                                       ("c.cls", b"0")])  # the bad label is the first sample of the second shard
    with pytest.raises(UserError) as caught:
        sources.open_splits(str(root), None, None, None)
    # the split and its shard, the label, the sample within the shard, the number of classes the label exceeds
    assert_names(single_line(str(caught.value)), "val", root / "val" / "w.tar", "4", "#1", "4")


def test_fingerprints_agree_wherever_equal_shards_lie_and_differ_when_one_does(written, tmp_path):
    paths, _ = written
    here = tar_shards.open_split(os.path.dirname(paths[0]), "train", None)
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(paths[0]), copy)
    assert tar_shards.open_split(str(copy), "train", None).fingerprint() == here.fingerprint()
    os.unlink(copy / "part-0003.tar")
    fewer = tar_shards.open_split(str(copy), "train", None)
    assert fewer.fingerprint() != here.fingerprint()
    assert np.array_equal(fewer.entries()[:60], here.entries()[:60])
    assert (fewer.entries()[60], here.entries()[60]) == (b"part-0004.tar:sample00080.jpg",
                                                         b"part-0003.tar:sample00060.jpg")


def test_a_folder_of_train_and_validation_shards_side_by_side_splits_by_name(side_by_side, image_folder):
    """As DATA; as --val-path beside another DATA; as a VAL of `evaluate` (which opens it as below)."""
    folder, classes = side_by_side
    train, val = sources.open_splits(str(folder), None, None, None)
    assert (len(train), len(val), train.classes) == (96, 35, classes)
    assert [os.path.basename(p) for p in val.shards] == ["imagenet1k-validation-0000.tar"]
    _, val = sources.open_splits(str(image_folder), str(folder), None, None)
    assert [os.path.basename(p) for p in val.shards] == ["imagenet1k-validation-0000.tar"] and len(val) == 35
    assert val.where() == f"{folder / '*validation*.tar'} (1 shard)"
    evaluated = sources.open_source(str(folder), "val", None, classes)
    assert len(evaluated) == 35 and evaluated.fingerprint() == val.fingerprint()


def test_validation_shards_named_valid_are_told_apart_from_train_ones(side_by_side):
    folder, _ = side_by_side
    os.rename(folder / "imagenet1k-validation-0000.tar", folder / "imagenet1k-valid-0000.tar")
    train, val = sources.open_splits(str(folder), None, None, None)
    assert [os.path.basename(p) for p in val.shards] == ["imagenet1k-valid-0000.tar"]
    assert "imagenet1k-valid-0000.tar" not in [os.path.basename(p) for p in train.shards]


@pytest.mark.parametrize("how", ["empty", "cut short", "not an npz", "an array missing"])
def test_a_damaged_index_cache_is_walked_again_with_a_note_and_a_damaged_pack_index_is_named(written, tmp_path,
                                                                                              how):
    from makers import damage

    paths, _ = written
    folder = tmp_path / "shards"
    shutil.copytree(os.path.dirname(paths[0]), folder)
    walked = tar_shards.open_split(str(folder), "train", str(tmp_path))
    walked.keep(str(tmp_path))
    cache = tar_shards.cache_path(str(tmp_path), "train")
    said = damage(cache, how, array="offsets")
    again = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert not again.cached and again.fingerprint() == walked.fingerprint()
    assert again.notes == (f"the shard index cache {cache} {said}: the shards were indexed again",)
    index = folder / tar_shards.INDEX_NAME  # as pack writes it, in OUT/train/ beside OUT/pack.json
    tar_shards.write_index(walked, str(index), relative_to=str(folder))
    (tmp_path / "pack.json").write_text(json.dumps({"source": "/data/imagenet", "options": {
        "max_side": None, "quality": 90, "shard_size": 20}}))
    damage(str(index), how, array="offsets")
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(folder), "train", str(tmp_path))
    # the index and its damage; the remedies: pack again with pack.json's source and options, or remove the index
    assert_names(single_line(str(caught.value)), index, said,
                 "imagenet-elastic pack /data/imagenet NEW_OUT --shard-size 20", index)


@pytest.mark.parametrize("order", [("png", "jpg"), ("jpg", "png"), ("webp", "jpeg"), ("webp", "PNG")])
def test_a_sample_with_several_images_takes_the_one_first_in_image_extensions_wherever_it_lies(tmp_path, order):
    write_tar(tmp_path / "s-0.tar", [*((f"a.{ext}", ext.encode()) for ext in order), ("a.cls", b"0"),
                                     ("b.jpg", b"jpg"), ("b.cls", b"1")])
    shards = tar_shards.open_split(str(tmp_path), "train", None)
    best = min(order, key=lambda ext: tar_shards.IMAGE_EXTENSIONS.index(ext.lower()))
    assert shards.read(0) == best.encode() and shards.member(0) == f"a.{best}"


@pytest.fixture
def side_by_side(image_folder, tmp_path):
    """timm's imagenet-1k-wds: imagenet1k-train-NNNN.tar and imagenet1k-validation-NNNN.tar in one folder, with an
    _info.json; and the class names."""
    for split, word in (("train", "train"), ("val", "validation")):
        for k, path in enumerate(wds_shards(image_folder / split, tmp_path / "tmp" / split, per_shard=40)):
            shutil.move(path, tmp_path / f"imagenet1k-{word}-{k:04d}.tar")
    classes = scan_image_folder(str(image_folder / "train"), "train").classes
    (tmp_path / "_info.json").write_text(json.dumps({"name": "imagenet-1k", "class_names": list(classes)}))
    shutil.rmtree(tmp_path / "tmp")
    return tmp_path, classes


@pytest.mark.parametrize("extra", ["imagenet1k-test-0000.tar", "imagenet1k-train-validation-0000.tar"])
def test_a_folder_of_both_splits_whose_names_do_not_tell_every_shards_split_is_refused(side_by_side, image_folder,
                                                                                        extra):
    folder, classes = side_by_side
    shutil.copy(folder / "imagenet1k-validation-0000.tar", folder / extra)
    said = f"{folder} holds train shards (imagenet1k-train-0000.tar ...) and validation shards (imagenet1k-" \
           f"validation-0000.tar ...), and {extra}, whose name says {'both' if 'train' in extra else 'neither'}: " \
           f"name each split's shards with a pattern ({folder / '*train*.tar'}, {folder / '*validation*.tar'})"
    for open_it in (lambda: sources.open_splits(str(folder), None, None, None),
                    lambda: sources.open_splits(str(image_folder), str(folder), None, None),
                    lambda: sources.open_source(str(folder), "val", None, classes)):
        with pytest.raises(UserError) as caught:
            open_it()
        assert str(caught.value) == said


@pytest.mark.parametrize(("labels", "unused"), [((b"0", b"1", b"3"), "2"), ((b"0", b"999"), "1..998")])
def test_numbered_labels_with_a_gap_are_refused_naming_the_shard_and_the_first_label_past_it(tmp_path, labels,
                                                                                             unused):
    """Without class names a stray label would make a model of its size, the classes between without a sample."""
    write_tar(tmp_path / "s-0.tar", [member for k, label in enumerate(labels)
                                     for member in ((f"k{k}.jpg", JPEG), (f"k{k}.cls", label))])
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path), "train", None)
    assert_names(single_line(str(caught.value)), tmp_path / "s-0.tar", f"label {labels[-1].decode()}",
                 f"labels {unused} unused")
    (tmp_path / "classes.txt").write_text("".join(f"c{k}\n" for k in range(int(labels[-1]) + 1)))
    assert len(tar_shards.open_split(str(tmp_path), "train", None)) == len(labels)  # named classes may go unused


def test_a_dangling_link_among_the_shards_is_one_line_naming_it(tmp_path):
    write_tar(tmp_path / "s-0.tar", [("a.jpg", JPEG), ("a.cls", b"0")])
    os.symlink(tmp_path / "gone.tar", tmp_path / "s-1.tar")
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path), "train", None)
    assert_names(single_line(str(caught.value)), tmp_path / "s-1.tar", "No such file")


@pytest.mark.parametrize(("name", "text", "said"), [
    ("classes.txt", "ant\n\nbee\n", "line 2 is blank"),
    ("_info.json", '{"class_names": "ant,bee"}', "not a list of names"),
    ("_info.json", '{"classes": [null, "bee"]}', "not a list of names"),
])
def test_class_names_that_would_shift_or_mean_nothing_are_refused_naming_the_file(tmp_path, name, text, said):
    """`ant, (blank), bee` would make label 1 the blank and label 2 bee; a string is not a list of names."""
    os.makedirs(tmp_path / "train")
    write_tar(tmp_path / "train" / "s-0.tar", [("a.jpg", JPEG), ("a.cls", b"0"), ("b.jpg", JPEG), ("b.cls", b"1")])
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path / "train"), "train", None)
    assert_names(single_line(str(caught.value)), tmp_path / name, said)


def test_shards_of_a_pack_not_finished_are_refused_naming_its_record_and_the_command_that_finishes_it(tmp_path):
    """pack.json is written first, `complete: false` until every split's index is: what an interrupted pack left."""
    os.makedirs(tmp_path / "out" / "train")
    write_tar(tmp_path / "out" / "train" / "train-000000.tar", [("a.jpg", JPEG), ("a.cls", b"0")])
    record = {"source": "/data/imagenet", "complete": False}
    (tmp_path / "out" / "pack.json").write_text(json.dumps(record))
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path / "out" / "train"), "train", None)
    assert_names(single_line(str(caught.value)), tmp_path / "out" / "pack.json",
                 f"imagenet-elastic pack /data/imagenet {tmp_path / 'out'}")
    (tmp_path / "out" / "pack.json").write_text(json.dumps({**record, "complete": True}))
    assert len(tar_shards.open_split(str(tmp_path / "out" / "train"), "train", None)) == 1


def test_a_classes_txt_written_after_the_shards_were_indexed_names_them_at_the_next_start(kept, tmp_path):
    folder, walked = kept
    assert walked.classes == ("0", "1", "2", "3")
    (tmp_path / "classes.txt").write_text("ant\nbee\ncat\ndog\n")  # one folder up from the shards
    again = tar_shards.open_split(str(folder), "train", str(tmp_path))
    assert again.classes == ("ant", "bee", "cat", "dog") and not again.cached and "class names" in again.notes[0]
    again.keep(str(tmp_path))
    assert tar_shards.open_split(str(folder), "train", str(tmp_path)).cached  # kept with the names


def test_a_shard_link_left_dangling_after_its_index_was_kept_is_one_line_naming_it(tmp_path):
    target = tmp_path / "elsewhere.tar"
    write_tar(target, [("a.jpg", JPEG), ("a.cls", b"0")])
    os.makedirs(tmp_path / "train")
    os.symlink(target, tmp_path / "train" / "s-0.tar")
    tar_shards.open_split(str(tmp_path / "train"), "train", str(tmp_path)).keep(str(tmp_path))
    target.unlink()
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path / "train"), "train", str(tmp_path))
    assert_names(single_line(str(caught.value)), tmp_path / "train" / "s-0.tar", "No such file")


def test_a_val_split_numbered_by_its_classes_txt_keeps_its_index_from_start_to_start(tmp_path):
    """Its names 0, 1 become the training split's before the index is kept: the same names, not a change."""
    os.makedirs(tmp_path / "val")
    write_tar(tmp_path / "val" / "s-0.tar", [("a.jpg", JPEG), ("a.cls", b"0"), ("b.jpg", JPEG), ("b.cls", b"1")])
    (tmp_path / "val" / "classes.txt").write_text("0\n1\n")
    first = tar_shards.open_split(str(tmp_path / "val"), "val", str(tmp_path), classes=("ant", "bee"))
    first.keep(str(tmp_path))
    again = tar_shards.open_split(str(tmp_path / "val"), "val", str(tmp_path), classes=("ant", "bee"))
    assert again.classes == ("ant", "bee") and again.cached and not again.notes


def test_a_stray_label_of_a_billion_is_refused_before_a_billion_class_names_are_made(tmp_path):
    write_tar(tmp_path / "s-0.tar", [("a.jpg", JPEG), ("a.cls", b"0"), ("b.jpg", JPEG), ("b.cls", b"1000000000")])
    with pytest.raises(UserError) as caught:
        tar_shards.open_split(str(tmp_path), "train", None)
    assert_names(single_line(str(caught.value)), "label 1000000000", "labels 1..999999999 unused")

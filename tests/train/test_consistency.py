"""What ranks compare at start (consistency.py): which differences count, in which order, and how
the first differing setting or file is named. The refusals of real multi-node jobs are in
test_multinode_checks.py."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from conftest import assert_names, single_line

from imagenet_elastic.config import Config
from imagenet_elastic.data.sources.image_folder import ImageFolder
from imagenet_elastic.train import consistency
from imagenet_elastic.train.consistency import (
    Fingerprint,
    first_difference,
    first_file_difference,
    setting_differences,
    settings_digest,
    shared_settings,
)


def index(entries: list[str], classes: tuple[str, ...] = ("cat", "dog")) -> ImageFolder:
    """An image folder of CLASS/NAME entries, in the order given (scan order)."""
    labels = [classes.index(e.split("/")[0]) for e in entries]
    return ImageFolder("/data/train", "train", classes, np.array([os.fsencode(e) for e in entries]),
                       np.array(labels, dtype=np.int64), np.array([b"."]), np.array([0]))


def file_list(source):
    return source.fingerprint()


FILES = ["cat/a.jpg", "cat/b.jpg", "cat/c.jpg", "dog/d.jpg", "dog/e.jpg"]


def test_equal_file_lists_have_equal_digests_wherever_the_data_lies():
    elsewhere = dataclasses.replace(index(FILES), root="/local/ssd/train", cached=True)
    assert file_list(index(FILES)) == file_list(elsewhere)


def test_a_missing_file_changes_the_list_and_is_named_with_where_the_lists_part():
    missing = index([f for f in FILES if f != "cat/b.jpg"])
    assert file_list(missing).count == 4 and file_list(missing) != file_list(index(FILES))
    main = index(FILES)
    said = first_file_difference(missing, consistency.listing(main), rank=1)
    assert said == "image #1 is 'cat/b.jpg' on rank 0 but 'cat/c.jpg' on rank 1"


def test_a_file_name_that_is_not_utf8_is_named_with_its_byte_shown():
    odd = os.fsdecode(b"cat/caf\xff.jpg")  # as a scan of the file system gives it
    said = first_file_difference(index(["cat/a.jpg", odd]), consistency.listing(index(FILES)), rank=1)
    assert said == "image #1 is 'cat/b.jpg' on rank 0 but 'cat/caf\\xff.jpg' on rank 1"


def test_a_file_moved_to_another_class_keeps_the_count_and_is_named():
    moved = index(["cat/a.jpg", "cat/c.jpg", "dog/b.jpg", "dog/d.jpg", "dog/e.jpg"])
    main = index(FILES)
    assert file_list(moved).count == file_list(main).count and file_list(moved) != file_list(main)
    said = first_file_difference(moved, consistency.listing(main), rank=3)
    assert said == "image #1 is 'cat/b.jpg' on rank 0 but 'cat/c.jpg' on rank 3"


def test_a_list_that_only_ends_early_says_where_the_other_goes_on():
    main, short = index(FILES), index(FILES[:-1])
    # where the lists part, the rank whose list goes on, and its next image
    said = first_file_difference(short, consistency.listing(main), rank=1)
    assert_names(single_line(said), "#4", "rank 0", "'dog/e.jpg'")
    said = first_file_difference(main, consistency.listing(short), rank=2)
    assert_names(single_line(said), "#4", "rank 2", "'dog/e.jpg'")
    said = first_file_difference(main, consistency.listing(main), rank=0)
    assert said == "the lists are the same"
    said = first_file_difference(main, consistency.listing(short), rank=2)
    assert_names(single_line(said), "#4", "rank 2", "'dog/e.jpg'")


def test_differing_class_folders_are_named():
    other = index(["cat/a.jpg", "eel/f.jpg"], classes=("cat", "eel"))
    main = index(FILES)
    said = first_file_difference(other, consistency.listing(main), rank=1)
    assert said == "classes only on rank 0: ['dog'], only on rank 1: ['eel']"


def test_settings_of_node_local_copies_and_resources_may_differ_but_not_the_recipe():
    base = Config(data="/shared/imagenet")
    local = dataclasses.replace(base, data="/local/imagenet", checkpoints_path="/mnt/ck", workers=3, threads=7,
                                master_port=1234, log_interval=5)
    assert settings_digest(shared_settings(local)) == settings_digest(shared_settings(base))
    for change in ({"batch_size": 32}, {"seed": 1}, {"model": "resnet18"}, {"amp": "bf16"}, {"resume": "auto"}):
        other = dataclasses.replace(base, **change)
        assert settings_digest(shared_settings(other)) != settings_digest(shared_settings(base)), change


def test_a_differing_setting_is_named_by_its_flag_with_both_values():
    main = shared_settings(Config(data="d"))
    mine = shared_settings(Config(data="d", batch_size=32, seed=3))
    assert setting_differences(mine, main, rank=1) == [
        "--batch-size is 64 on rank 0 but 32 on rank 1", "--seed is 0 on rank 0 but 3 on rank 1"]
    assert setting_differences(main, main, rank=1) == []


def fingerprint(**changes) -> Fingerprint:
    same = file_list(index(FILES))
    base = Fingerprint("imagenet_elastic 0.1.0 (source abc), torch 2.6", "s1", "token", (12, 96, 1.5), same, same,
                       "node-a", "/shared/ck")
    return dataclasses.replace(base, **changes)


def test_identical_fingerprints_from_other_hosts_and_folder_names_are_one_job():
    assert first_difference([fingerprint(), fingerprint(host="node-b", folder="/mnt/ck")]) is None


def test_the_first_differing_field_is_reported_with_every_rank_that_differs():
    prints = [fingerprint(), fingerprint(settings="s2", val=file_list(index(FILES[:2]))), fingerprint(),
              fingerprint(settings="s2")]
    assert first_difference(prints) == ("settings", [1, 3])
    prints = [fingerprint(), fingerprint(folder_token=None, checkpoint=None), fingerprint(software="other")]
    assert first_difference(prints) == ("software", [2])  # other code explains other behaviour: said first


def test_an_unshared_checkpoints_folder_is_said_with_both_paths_and_why_it_matters():
    prints = [fingerprint(), fingerprint(folder_token=None, checkpoint=None, host="node-b", folder="/local/ck")]
    name, ranks = first_difference(prints)
    said = consistency.describe(name, ranks, prints, Config(data="d"), index(FILES), index(FILES))
    # what is wrong; the rank that does not see the lock and its host, the holder and its host, both paths
    assert_names(said, "checkpoints folder", "not shared", "rank 1 (node-b)", "rank 0 (node-a)", "/shared/ck",
                 "/local/ck")
    assert "starts over from nothing" in said


def test_ranks_that_read_other_teacher_weights_are_one_job_no_more():
    """Each rank reads --teacher from its own node (a Hugging Face cache, a file): the weights' hashes must agree."""
    prints = [fingerprint(teacher="a" * 64), fingerprint(teacher="a" * 64, host="node-b"),
              fingerprint(teacher="b" * 64, host="node-c")]
    name, ranks = first_difference(prints)
    said = consistency.describe(name, ranks, prints, Config(data="d", teacher="resnet50.a1_in1k"), index(FILES),
                                index(FILES))
    # the flag and its weights; each rank that differs with its host and its hash's first 12 digits; where to look
    assert_names(single_line(said), "--teacher resnet50.a1_in1k", "rank 0 (node-a)", "aaaaaaaaaaaa", "rank 2 (node-c)",
                 "bbbbbbbbbbbb", "Hugging Face cache")
    assert "node-b" not in said and "a" * 13 not in said  # rank 1 holds rank 0's weights: not named

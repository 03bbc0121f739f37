"""`imagenet-elastic evaluate MODEL VAL`: timm's own evaluation path's top-1 on our checkpoint and on its export, ReaL
and class-subset scores against hand-computed ones, numbered class folders, several val sets at once, and every bad
input as one line."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest
import timm
import torch
from conftest import SMALL_RUN, assert_names, finish, start, torchrun_cmd
from inprocess import InMemory, command, train
from makers import training_images
from PIL import Image
from timm.data import create_transform, resolve_data_config

from imagenet_elastic.data import pipeline
from imagenet_elastic.errors import UserError
from imagenet_elastic.report.metrics import read as read_metrics
from imagenet_elastic.tools.eval_labels import read_real_labels
from imagenet_elastic.tools.export import export

CLASSES = ("a", "b", "c")
VAL_IMAGES = 30


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained here for 2 epochs (unsure of many images), its export, and its validation images in class
    folders on disk; and timm's evaluation of the export on them: each image's logits, as timm's validate.py gets
    them (resolve_data_config + create_transform, the model's forward, fp32)."""
    root = tmp_path_factory.mktemp("evaluate")
    train_images, train_labels = training_images(60, 3, seed=1)
    val_images, val_labels = training_images(VAL_IMAGES, 3, seed=2)
    for i, (raw, label) in enumerate(zip(val_images, val_labels)):
        folder = root / "val" / CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"ILSVRC2012_val_{i + 1:08d}.JPEG").write_bytes(raw)
    splits = (InMemory("train", CLASSES, train_images, train_labels),
              InMemory("val", CLASSES, val_images, val_labels))
    train(["unused", *SMALL_RUN, "--epochs", "2", "--lr", "0.5", "--workers", "0", "--checkpoints-path",
           str(root / "run")], splits=splits)
    export(str(root / "run" / "last.pt"), str(root / "export"), ema=False)
    model = timm.create_model(f"local-dir:{root / 'export'}", pretrained=True).eval()
    transform = create_transform(**resolve_data_config({}, model=model))
    with torch.no_grad():
        logits = model(torch.stack([transform(Image.open(io.BytesIO(raw)).convert("RGB")) for raw in val_images]))
    return root, logits, torch.from_numpy(val_labels)


def evaluated(*argv: str) -> list[dict]:
    done = command(["evaluate", *argv, "--workers", "0", "--amp", "none"])
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def top1(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return 100 * float((logits.argmax(1) == labels).float().mean())


def test_evaluate_scores_timms_top1_on_our_checkpoint_and_on_its_export(trained):
    root, logits, labels = trained
    expected = top1(logits, labels)
    assert 30 < expected < 100  # a model unsure of some images: a pixel or label mismatch would show
    [ours] = evaluated(str(root / "run" / "last.pt"), str(root / "val"))
    [exported] = evaluated(str(root / "export"), str(root / "val"))
    for row in (ours, exported):
        assert row["images"] == VAL_IMAGES and row["top1"] == pytest.approx(expected)
        assert (row["crop"], row["resize"], row["interpolation"]) == (32, 37, "bilinear")
    assert read_metrics(root / "run" / "metrics.jsonl")[-1]["val_top1"] == pytest.approx(expected)


def test_a_runs_checkpoints_folder_is_scored_as_its_best_checkpoint(trained):
    root, _, _ = trained
    [folder] = evaluated(str(root / "run"), str(root / "val"))
    [best] = evaluated(str(root / "run" / "best.pt"), str(root / "val"))
    assert folder.pop("model") == str(root / "run") and best.pop("model") == str(root / "run" / "best.pt")
    assert folder == best


def test_numbered_class_folders_name_the_models_classes_by_position(trained, tmp_path):
    """ImageNet-V2's layout: folders 0..N-1, folder k holding class k (sorted as text, 10 before 2)."""
    root, logits, labels = trained
    for k, name in enumerate(CLASSES):
        os.symlink(root / "val" / name, tmp_path / str(k))
    [row] = evaluated(str(root / "export"), str(tmp_path))
    assert row["top1"] == pytest.approx(top1(logits, labels)) and row["images"] == VAL_IMAGES


def test_real_top1_counts_images_with_real_labels_right_when_the_top1_is_among_them(trained, tmp_path):
    """real.json made by hand from timm's predictions: image 1 lists its prediction (right), image 2 nothing
    (skipped), image 3 only another class (wrong), image 4 its prediction and another (right), image 5 two others
    (wrong); the other 25 list nothing. ReaL top-1: 2 right of 4 counted = 50%."""
    root, logits, labels = trained
    guess = logits.argmax(1).tolist()
    real: list[list[int]] = [[] for _ in range(VAL_IMAGES)]
    real[0] = [guess[0]]
    real[2] = [(guess[2] + 1) % 3]
    real[3] = [(guess[3] + 2) % 3, guess[3]]
    real[4] = [(guess[4] + 1) % 3, (guess[4] + 2) % 3]
    (tmp_path / "real.json").write_text(json.dumps(real))
    [row] = evaluated(str(root / "export"), str(root / "val"), "--real-labels", str(tmp_path / "real.json"))
    assert (row["real_top1"], row["real_images"]) == (50.0, 4)
    assert row["top1"] == pytest.approx(top1(logits, labels))


def test_a_class_subset_scores_only_its_classes_logits(trained, tmp_path):
    """Classes a and c alone (ImageNet-A/-R's way): an image of a that the model calls b counts as right when its
    logit of a beats that of c. Expected: the argmax over columns 0 and 2 of timm's logits, by hand."""
    root, logits, labels = trained
    for name in ("a", "c"):
        os.symlink(root / "val" / name, tmp_path / name)
    (tmp_path / "subset.txt").write_text("c\na\n")
    [row] = evaluated(str(root / "export"), str(tmp_path), "--class-subset", str(tmp_path / "subset.txt"))
    kept = labels != 1
    pair = logits[kept][:, [0, 2]]
    right = sum(1 for (la, lc), label in zip(pair.tolist(), labels[kept].tolist()) if (la > lc) == (label == 0))
    assert row["images"] == int(kept.sum()) and row["classes"] == 2
    assert row["top1"] == pytest.approx(100 * right / int(kept.sum()))
    assert row["top5"] == 100.0  # two classes: both are in every top-5
    # the loss too: with two classes a top-1 of 50% stays 50% when the columns are swapped, the loss does not
    loss = float(torch.nn.functional.cross_entropy(pair, (labels[kept] == 2).long()))
    assert row["loss"] == pytest.approx(loss, rel=1e-4)
    full = top1(logits[kept], labels[kept])
    print(f"subset top-1 {row['top1']:.2f} against {full:.2f} over all three classes")


def test_several_val_sets_of_any_source_give_a_line_each_and_a_table(trained, tmp_path):
    """Class folders, the flat folder with its labels file, and tar shards packed from the folders: the same images,
    the same scores, ReaL's included (found by the number in each image's name, in a shard's member too)."""
    root, logits, labels = trained
    flat = tmp_path / "flat"
    flat.mkdir()
    rows = []
    for path in sorted((root / "val").rglob("*.JPEG")):
        os.symlink(path, flat / path.name)
        rows.append(f"{path.name},{path.parent.name}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "src").mkdir()
    for split in ("train", "val"):
        os.symlink(root / "val", tmp_path / "src" / split)
    assert command(["pack", str(tmp_path / "src"), str(tmp_path / "packed"), "--workers", "1"]).returncode == 0
    (tmp_path / "real.json").write_text(json.dumps([[(k + 1) % 3] for k in range(VAL_IMAGES)]))  # not the labels
    places = [str(root / "val"), str(flat), str(tmp_path / "packed" / "val")]
    done = command(["evaluate", str(root / "export"), *places, "--val-labels", str(tmp_path / "labels.csv"),
                    "--real-labels", str(tmp_path / "real.json"), "--workers", "0", "--amp", "none"])
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["val"] for line in lines] == places
    guess = logits.argmax(1)
    real = 100 * float((guess == (torch.arange(VAL_IMAGES) + 1) % 3).float().mean())
    for line in lines:
        assert line["images"] == VAL_IMAGES and line["top1"] == pytest.approx(top1(logits, labels))
        assert line["real_top1"] == pytest.approx(real) and line["real_images"] == VAL_IMAGES
    assert real != top1(logits, labels)
    assert "scores" in done.stdout and done.stdout.count(f"top-1 {top1(logits, labels):.2f}%") == 3
    assert done.stdout.count(f"ReaL {real:.2f}%") == 3


def test_a_root_holding_a_flat_val_folder_is_scored_as_its_val_split_with_val_labels(trained, tmp_path):
    """ROOT/val of images alone, ImageNet's validation set as distributed: with --val-labels, ROOT's val split (without,
    a split whose one class is `val`)."""
    root, logits, labels = trained
    (tmp_path / "root" / "val").mkdir(parents=True)
    rows = []
    for path in sorted((root / "val").rglob("*.JPEG")):
        os.symlink(path, tmp_path / "root" / "val" / path.name)
        rows.append(f"{path.name},{path.parent.name}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    [row] = evaluated(str(root / "export"), str(tmp_path / "root"), "--val-labels", str(tmp_path / "labels.csv"))
    assert row["val"] == str(tmp_path / "root" / "val") and row["images"] == VAL_IMAGES
    assert row["top1"] == pytest.approx(top1(logits, labels))


def test_prefixed_locations_parquet_files_and_a_data_root_are_read_as_training_reads_them(trained, tmp_path):
    """`folder:DIR`, `parquet:DIR` (HF-style files, without class names) and a data root (a pack's output, the
    README's DATA: its val split): the same images, the same scores."""
    from makers import write_parquet

    root, logits, labels = trained
    (tmp_path / "src").mkdir()
    for split in ("train", "val"):
        os.symlink(root / "val", tmp_path / "src" / split)
    assert command(["pack", str(tmp_path / "src"), str(tmp_path / "packed"), "--workers", "1"]).returncode == 0
    images = sorted((root / "val").rglob("*.JPEG"))
    (tmp_path / "hf").mkdir()
    write_parquet(tmp_path / "hf" / "validation-00000-of-00001.parquet", [p.read_bytes() for p in images],
                  [CLASSES.index(p.parent.name) for p in images], None, 8)
    places = [f"folder:{root / 'val'}", f"parquet:{tmp_path / 'hf'}", str(tmp_path / "packed")]
    rows = evaluated(str(root / "export"), *places)
    assert [row["val"] for row in rows] == [places[0], places[1], str(tmp_path / "packed" / "val")]
    for row in rows:
        assert row["images"] == VAL_IMAGES and row["top1"] == pytest.approx(top1(logits, labels))


def test_a_label_beyond_the_models_classes_speaks_of_the_model_not_the_training_split(trained, tmp_path):
    from makers import write_parquet

    root, _, _ = trained
    image = next((root / "val").rglob("*.JPEG")).read_bytes()
    write_parquet(tmp_path / "validation.parquet", [image] * 3, [0, 1, 3], None, 8)  # the model has 3 classes
    said = one_line_error(str(root / "export"), str(tmp_path / "validation.parquet"))
    assert "label 3 of row 2 is out of range: the model has 3 classes" in said and "training" not in said


def test_a_timm_model_name_takes_its_own_preprocessing_and_imagenets_class_names(trained, tmp_path, monkeypatch):
    """--pretrained with a timm name (its download stood in for by a seeded 1000-class model with a bicubic, 0.9
    crop config of its own). VAL's folders are ImageNet wnids, each image put in the folder of the class timm's own
    evaluation path predicts for it: 100% there, and here exactly when every prediction agrees."""
    from timm.data import ImageNetInfo

    root, _, _ = trained
    real_create_model = timm.create_model

    def published(name: str, pretrained: bool = False, **kwargs):
        assert (name, pretrained) == ("test_resnet.fake_in1k", True)
        torch.manual_seed(3)
        return real_create_model("test_resnet", num_classes=1000,
                                 pretrained_cfg_overlay={"interpolation": "bicubic", "crop_pct": 0.9})

    monkeypatch.setattr(timm, "create_model", published)
    model = published("test_resnet.fake_in1k", True).eval()
    data = resolve_data_config({}, model=model)
    assert (data["interpolation"], data["crop_pct"], data["mean"]) == ("bicubic", 0.9, (0.5, 0.5, 0.5))
    transform = create_transform(**data)
    wnids = ImageNetInfo("imagenet-1k").label_names()
    images = sorted((root / "val").rglob("*.JPEG"))
    with torch.no_grad():
        guess = model(torch.stack([transform(Image.open(path).convert("RGB")) for path in images])).argmax(1)
    for path, k in zip(images, guess.tolist()):
        (tmp_path / "val" / wnids[k]).mkdir(parents=True, exist_ok=True)
        os.symlink(path, tmp_path / "val" / wnids[k] / path.name)
    [row] = evaluated("test_resnet.fake_in1k", str(tmp_path / "val"), "--pretrained")
    assert (row["crop"], row["resize"], row["interpolation"], row["mean"]) == (160, 177, "bicubic", [0.5] * 3)
    assert row["images"] == VAL_IMAGES and row["top1"] == 100.0


def test_flip_average_our_preprocessing_and_the_device_decoder_are_options(trained):
    root, logits, labels = trained
    [plain] = evaluated(str(root / "export"), str(root / "val"), "--preprocessing", "ours")
    [flipped] = evaluated(str(root / "export"), str(root / "val"), "--flip-average")
    [device] = evaluated(str(root / "export"), str(root / "val"), "--decode", "gpu")  # on the CPU: within a level
    assert plain["top1"] == pytest.approx(top1(logits, labels))  # the export's preprocessing is ours
    assert flipped["flip_average"] is True and flipped["loss"] != plain["loss"]
    assert device["images"] == plain["images"] and abs(device["top1"] - plain["top1"]) <= 100 / plain["images"]
    assert device["loss"] == pytest.approx(plain["loss"], rel=1e-2) and device["loss"] != plain["loss"]


def test_the_loaders_prefetch_as_far_ahead_as_the_trainers_for_batches_at_the_crop_size(trained, monkeypatch):
    """Within the trainer's pinned-memory budget on CUDA (pipeline.prefetch_factor); on this CPU, not pinned."""
    root, _, _ = trained
    asked = []

    def prefetch_factor(workers: int, batch_bytes: int, pinned: bool) -> int:
        asked.append((workers, batch_bytes, pinned))
        return 4

    monkeypatch.setattr(pipeline, "prefetch_factor", prefetch_factor)
    evaluated(str(root / "export"), str(root / "val"), str(root / "val"), "--batch-size", "5")
    assert asked == [(0, 5 * 32 * 32 * 3, False)]  # one factor for the two sets, read one after the other


def one_line_error(*argv: str) -> str:
    done = command(["evaluate", *argv, "--workers", "0"])
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("imagenet-elastic: error: ")
    return lines[0]


def test_bad_inputs_are_one_line_naming_the_culprit(trained, tmp_path):
    root, _, _ = trained
    model, val = str(root / "export"), str(root / "val")
    assert "--real-labels" in one_line_error(model, val, "--real-labels", str(tmp_path / "missing.json"))
    (tmp_path / "subset.txt").write_text("a\nzebra\n")
    said = one_line_error(model, val, "--class-subset", str(tmp_path / "subset.txt"))
    assert "line 2" in said and "'zebra'" in said
    (tmp_path / "ac.txt").write_text("a\nc\n")
    assert "outside --class-subset" in one_line_error(model, val, "--class-subset", str(tmp_path / "ac.txt"))
    for missing in (str(tmp_path / "nowhere"), f"parquet:{tmp_path / 'nowhere'}"):
        said = one_line_error(model, missing)
        assert f"VAL {missing} does not exist: evaluate takes " in said and "parquet files" in said
        assert "(folder:, parquet:, wds:)" in said
    (tmp_path / "root" / "train").mkdir(parents=True)
    assert f"VAL {tmp_path / 'root'} is a data root (it holds train/) without val/" in one_line_error(
        model, str(tmp_path / "root"))
    assert "needs --pretrained" in one_line_error("resnet18", val)
    assert "has no weight average" in one_line_error(str(root / "run" / "last.pt"), val, "--ema")
    assert "--ema applies to our checkpoints only" in one_line_error(model, val, "--ema")
    # the argument, and both places it was looked for: the disk, then timm's models
    assert_names(one_line_error("no_such_model_xyz", val, "--pretrained"), "MODEL no_such_model_xyz", "file or folder",
                 "timm")
    (tmp_path / "odd" / "zebra").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "odd" / "zebra" / "x.jpg")
    assert "the model does not have" in one_line_error(model, str(tmp_path / "odd"))
    (tmp_path / "odd.json").write_text(json.dumps({"not": "a list"}))
    assert "not a list of lists" in one_line_error(model, val, "--real-labels", str(tmp_path / "odd.json"))
    (tmp_path / "short.json").write_text(json.dumps([[0]]))
    assert "has 1 entry: none for" in one_line_error(model, val, "--real-labels", str(tmp_path / "short.json"))
    (tmp_path / "outside.json").write_text(json.dumps([[0], [2, 1], [1, 3, 7], [9]] + [[]] * 30))
    # the flag, its file, the entry and its image, the class out of range, the model's number of classes
    assert_names(one_line_error(model, val, "--real-labels", str(tmp_path / "outside.json")), "--real-labels",
                 tmp_path / "outside.json", "entry 3", "(ILSVRC2012_val_00000003)", "class 3", "3 classes")
    (tmp_path / "long.json").write_text(json.dumps([[0]] * 50_001))
    # the flag, its file, its entries, real.json's, and the first entry that names no image
    assert_names(one_line_error(model, val, "--real-labels", str(tmp_path / "long.json")), "--real-labels",
                 tmp_path / "long.json", "50001", "real.json", "50000", "entry 50001")


def test_real_labels_of_exactly_imagenets_50000_validation_images_are_read_and_one_more_refused(tmp_path):
    """ReaL's own real.json has an entry per validation image, 50,000: all of them are read."""
    entries = [[k % 3] if k % 7 else [] for k in range(50_000)]
    (tmp_path / "real.json").write_text(json.dumps(entries))
    assert read_real_labels(str(tmp_path / "real.json")) == entries
    (tmp_path / "long.json").write_text(json.dumps([*entries, [0]]))
    with pytest.raises(UserError) as caught:
        read_real_labels(str(tmp_path / "long.json"))
    assert_names(str(caught.value), tmp_path / "long.json", "50001 entries", "50000", "entry 50001")


@pytest.mark.parametrize("entries", [[], [[True], [0]]], ids=["empty", "a_boolean"])
def test_real_labels_that_are_no_list_of_class_numbers_are_one_line_naming_the_file(tmp_path, entries):
    (tmp_path / "real.json").write_text(json.dumps(entries))
    with pytest.raises(UserError) as caught:
        read_real_labels(str(tmp_path / "real.json"))
    assert_names(str(caught.value), "--real-labels", tmp_path / "real.json")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.usefixtures("warm_ranks")  # the ranks torchrun starts: forks of the warm python
def test_under_torchrun_every_world_size_scores_every_image_once(trained, tmp_path):
    """29 images over 1, 2 and 3 ranks (shards of 15/14 and 10/10/9): the same counts, ReaL's included."""
    root, _, _ = trained
    val = tmp_path / "val"
    for path in sorted((root / "val").rglob("*.JPEG"))[:-1]:
        (val / path.parent.name).mkdir(parents=True, exist_ok=True)
        os.symlink(path, val / path.parent.name / path.name)
    (tmp_path / "real.json").write_text(json.dumps([[k % 3] if k % 4 else [] for k in range(VAL_IMAGES)]))
    args = [str(root / "export"), str(val), "--real-labels", str(tmp_path / "real.json")]
    jobs = {world: start(torchrun_cmd(world, "evaluate", *args, "--workers", "0", "--amp", "none"))
            for world in (2, 3)}  # side by side, and one rank in this process meanwhile
    [row] = evaluated(*args)
    assert row["world_size"] == 1
    rows = [row]
    for world, job in jobs.items():
        done = finish(job)
        assert done.returncode == 0, done.stdout + done.stderr
        [row] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert row["world_size"] == world
        rows.append(row)
    for row in rows[1:]:
        for key in ("images", "top1", "top5", "real_top1", "real_images"):
            assert row[key] == rows[0][key], (key, row, rows[0])
        assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)  # float32 sums of other batches
    assert rows[0]["images"] == 29


def test_names_a_model_repeats_are_matched_by_position_in_its_own_list_and_refused_by_name_elsewhere():
    """ImageNet's names hold `crane` twice (the bird, the machine): a dict by name scored both as the second."""
    import types

    from imagenet_elastic.errors import UserError
    from imagenet_elastic.tools.eval_labels import model_index

    model = ("cat", "crane", "dog", "crane")
    assert model_index(types.SimpleNamespace(classes=model), model, "v").tolist() == [0, 1, 2, 3]
    assert model_index(types.SimpleNamespace(classes=("dog", "cat")), model, "v").tolist() == [2, 0]
    with pytest.raises(UserError) as caught:
        model_index(types.SimpleNamespace(classes=("crane", "dog")), model, "v")
    assert_names(str(caught.value), "VAL v", "'crane'", "1, 3")


def test_an_export_without_class_names_scores_numbered_folders_by_position(trained, tmp_path):
    """timm's save_for_hf writes label_names only when the model has them: outputs are then known by number."""
    root, logits, labels = trained
    unnamed, val = tmp_path / "unnamed", tmp_path / "val"
    shutil.copytree(root / "export", unnamed)
    config = json.loads((unnamed / "config.json").read_text())
    config.pop("label_names", None)
    config.get("pretrained_cfg", {}).pop("label_names", None)
    (unnamed / "config.json").write_text(json.dumps(config))
    val.mkdir()
    for k, name in enumerate(CLASSES):
        os.symlink(root / "val" / name, val / str(k))
    [row] = evaluated(str(unnamed), str(val))
    assert row["top1"] == pytest.approx(top1(logits, labels)) and row["images"] == VAL_IMAGES

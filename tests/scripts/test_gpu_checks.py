"""scripts/gpu_checks.sh runs as it is: every part, on a CPU with a tiny model (MODEL, BATCH, SIZE and BATCHES from the
environment), prints the JSON lines it promises, and exits 0 (the `restart` part is
tests/system/test_resume_layout.py's two-rank resume), so that no GPU time goes to a flag the benchmark no longer
takes. The two entries, `proof` and `proof_rest`, are tests/scripts/test_gpu_proof.py's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, TRAIN_IMAGES, VAL_IMAGES, child_env

pytestmark = pytest.mark.slow  # each part starts its processes one after another

SMALL = {"PYTHON": sys.executable, "MODEL": "test_resnet", "BATCH": "8", "SIZE": "32", "BATCHES": "2"}
PYTHON = {}  # the test run's warm python (tests/warm_python.py): PYTHON of every part


@pytest.fixture(autouse=True)
def python(warm_python):
    """The parts' python commands run in forks of one interpreter that imported torch once, not a new one each."""
    PYTHON["PYTHON"] = warm_python
    yield warm_python
    PYTHON.clear()


def gpu_checks(part: str, data, work, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_checks.sh", part, str(data), str(work)], cwd=REPO,
                          env=child_env(**{**SMALL, **PYTHON, **env}), capture_output=True, text=True, timeout=180)


def figures(part: str, data, work, **env: str) -> list[dict]:
    result = gpu_checks(part, data, work, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines, result.stderr
    return [json.loads(line) for line in lines]  # stdout is JSON lines only: they are pasted into BENCHMARKS.md


def settings(lines: list[dict], *keys: str) -> list[tuple]:
    return [tuple(line[k] for k in keys) for line in lines]


def test_the_data_part_counts_a_folder_that_exists_rather_than_making_it_again(image_folder, tmp_path):
    (data,) = figures("data", image_folder, tmp_path)
    assert data == {"data": str(image_folder), "train_images": TRAIN_IMAGES}


def test_synthetic_part_measures_both_layouts_both_precisions_and_the_blur(image_folder, tmp_path):
    lines = figures("synthetic", image_folder, tmp_path)
    assert settings(lines, "mode", "amp", "channels_last", "blurpool", "compile") == [
        ("synthetic", "bf16", True, False, False), ("synthetic", "bf16", False, False, False),
        ("synthetic", "fp16", True, False, False), ("synthetic", "bf16", True, True, False)]
    assert all((line["model"], line["batch_size"], line["image_size"]) == ("test_resnet", 8, 32) for line in lines)
    assert all(line["images_per_sec"] > 0 for line in lines)


def test_device_ops_part_counts_the_device_paths_operators_at_three_batch_sizes_plain_and_with_the_policy(
        image_folder, tmp_path):
    lines = figures("device_ops", image_folder, tmp_path)
    assert settings(lines, "batch", "auto_augment") == [(b, policy) for policy in ("none", "ta_wide")
                                                        for b in (64, 128, 256)]
    for plain_or_policy in (lines[:3], lines[3:]):  # constant in the batch size (on the CPU's tensors here)
        assert len({line["ops"] for line in plain_or_policy}) == 1 and plain_or_policy[0]["ops"] > 0
    assert lines[3]["ops"] > lines[0]["ops"] and all(line["decoder_calls"] == 1 for line in lines)


def test_loader_and_checkpoint_parts(image_folder, tmp_path):
    loader = figures("loader", image_folder, tmp_path, ROUNDS="1")
    assert settings(loader, "mode", "decode", "auto_augment") == [
        ("loader", decode, policy) for decode in ("cpu", "gpu") for policy in ("none", "ta_wide")]
    (checkpoint,) = figures("checkpoint", image_folder, tmp_path)
    assert checkpoint["mode"] == "checkpoint" and checkpoint["model"] == "test_resnet"


def test_train_part_ends_with_the_epochs_metrics_row(image_folder, tmp_path):
    (row,) = figures("train", image_folder, tmp_path)
    assert (row["epoch"], row["world_size"], row["val_samples"]) == (1, 1, VAL_IMAGES)
    assert (tmp_path / "ckpt" / "last.pt").exists()


def unknown_part(stderr: str) -> str:
    """The part a one-line refusal names."""
    [said] = stderr.strip().splitlines()
    return re.fullmatch(r"unknown part '([^']*)'.*", said).group(1)


def test_a_part_that_needs_data_it_does_not_have_or_an_unknown_part_is_one_line(tmp_path):
    missing = gpu_checks("synthetic", tmp_path / "nowhere", tmp_path)
    assert missing.returncode == 2 and missing.stdout == ""
    [said] = missing.stderr.strip().splitlines()  # one line, naming the folder and the part that makes it
    assert str(tmp_path / "nowhere") in said and "gpu_checks.sh data" in said
    unknown = gpu_checks("synthetics", tmp_path, tmp_path)
    assert unknown.returncode == 2 and unknown_part(unknown.stderr) == "synthetics"


def test_several_parts_run_on_past_a_failing_one_and_each_says_how_it_ended(tmp_path):
    """One command runs a list of parts: a failing part (here one without data) does not cost the parts after it."""
    result = gpu_checks("synthetic,versions", tmp_path / "nowhere", tmp_path)
    assert result.returncode == 1, result.stderr
    failed, versions, done = (json.loads(line) for line in result.stdout.splitlines())
    assert {k: failed[k] for k in ("part", "exit")} == {"part": "synthetic", "exit": 2}
    assert "no data at" in result.stderr and versions["gpu"] is None
    assert {"torch", "torchvision", "timm", "cuda", "cudnn"} <= versions["versions"].keys()
    assert {k: done[k] for k in ("part", "exit")} == {"part": "versions", "exit": 0} and done["seconds"] >= 0
    unknown = gpu_checks("versions,synthetics", tmp_path, tmp_path)  # refused before any part runs
    assert (unknown.returncode, unknown.stdout) == (2, "")
    assert unknown_part(unknown.stderr) == "synthetics"

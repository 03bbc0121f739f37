"""scripts/gpu_checks.sh's two entries (`proof`, the 8-minute run, and `proof_rest`, what it skipped or failed) run
on a CPU with a tiny model, make their data, print only JSON lines, and judge every target; the time guard skips
what would not fit and `proof_rest` runs exactly that. On a GPU the same commands take the real model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import warm_python
from conftest import REPO, child_env
from PIL import Image

pytestmark = pytest.mark.slow  # each entry starts a dozen processes

TINY = {"PYTHON": sys.executable, "MODEL": "test_resnet", "BATCH": "8", "SIZE": "32", "BATCHES": "2",
        "CLASSES": "4", "TRAIN_PER_CLASS": "8", "IMAGE": "100x75", "RESTART_STEPS": "2",
        "TORCHDYNAMO_DISABLE": "1"}  # --compile's commands without the compiler (a minute a model on these CPUs)
CUDA_MARK = re.compile(r"^(@pytest\.mark\.cuda|pytestmark = .*pytest\.mark\.cuda)", re.MULTILINE)
CASES = ["limit", "cpu_N", "gpu_N", "cpu_4", "gpu_4", "recipe_gpu", "plain_gpu", "recipe_cpu", "plain_cpu",
         "gpu_N_nvimgcodec", "gpu_4_nvimgcodec"]


def photos(folder: Path) -> Path:
    folder.mkdir()
    for k in range(2):
        pixels = (np.random.default_rng(k).random((120, 160, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"photo{k}.png")
    return folder


@pytest.fixture
def python(tmp_path):
    """The entries' python commands (their driver's children too) run in forks of one interpreter that imported
    torch once, not a new one each."""
    with warm_python.serving(child_env(**TINY), tmp_path / "python") as shim:
        yield shim


def entry(python: str, part: str, data: Path, out: Path, **env: str) -> list[dict]:
    result = subprocess.run(["bash", "scripts/gpu_checks.sh", part, str(data), str(out)], cwd=REPO,
                            env=child_env(**{**TINY, "PYTHON": python, **env}), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(text) for text in result.stdout.splitlines()]  # stdout is JSON lines only
    assert lines == [json.loads(text) for text in (out / "proof.jsonl").read_text().splitlines()]
    return lines


def statuses(lines: list[dict], key: str) -> dict[str, str]:
    return {line[key]: line["status"] for line in lines if key in line and "status" in line}


def test_the_proof_skips_what_would_not_fit_and_the_rest_runs_just_that(python, tmp_path):
    """A 100-second budget holds neither the CUDA tests (150 s on an H100), nor the restart (150 s), nor a model
    compiled cold (110 s) and run: each says so, the eager cases run and are judged. `proof_rest` on that run's
    lines runs the tests, both restart rounds and the compiled cases (the limit first), and no eager case again."""
    data, first, rest = tmp_path / "data", tmp_path / "first", tmp_path / "rest"
    lines = entry(python, "proof", data, first, BUDGET="100", PHOTOS=str(photos(tmp_path / "photos")))
    workers = lines[0]["workers"]
    names = [name.replace("_N", f"_{workers}") for name in CASES]
    eager = ["recipe_gpu", "plain_gpu", "recipe_cpu", "plain_cpu"]
    compiled = [name for name in names if name not in eager]
    assert lines[0]["cases"] == names and len(list((data / "train").rglob("*.jpg"))) == 32
    parts = statuses(lines, "part")
    assert {k: parts[k] for k in ("versions", "data", "tests", "restart", "throughput")} == {
        "versions": "ok", "data": "ok", "tests": "skipped", "restart": "skipped", "throughput": "ok"}
    assert statuses(lines, "case") == {**dict.fromkeys(compiled, "skipped"), **dict.fromkeys(eager, "ok")}
    rates = {line["case"]: line for line in lines if line.get("status") == "ok" and "case" in line}
    assert [rates["recipe_gpu"][k] for k in ("decode", "image_size", "auto_augment", "random_erase", "compile")] == [
        "gpu", 25, "ta_wide", 0.1, False]
    assert [rates["plain_cpu"][k] for k in ("decode", "workers", "auto_augment")] == ["cpu", workers, "none"]
    targets = {t["target"]: t for t in lines[-2]["targets"]}
    assert len(targets) == 11 and targets["every CUDA test passes"]["holds"] is None  # not run: not judged
    assert targets["recipe_gpu >= 0.9 of plain_gpu"]["figure"] == round(
        rates["recipe_gpu"]["images_per_sec"] / rates["plain_gpu"]["images_per_sec"], 3)
    assert lines[-1]["proof"] == "end"

    redo = entry(python, "proof_rest", data, rest, EARLIER=str(first))
    assert redo[0]["parts"] == ["restart", "restart_warm", "tests"] and redo[0]["cases"] == compiled
    assert statuses(redo, "part") == {"versions": "ok", "data": "ok", "tests": "ok", "restart": "ok",
                                      "restart_warm": "ok", "throughput": "ok"}
    assert statuses(redo, "case") == dict.fromkeys(compiled, "ok")
    rates = {line["case"]: line for line in redo if "case" in line}
    assert (rates["limit"]["mode"], rates["limit"]["num_classes"], rates["limit"]["compile"]) == ("synthetic", 4, True)
    assert [rates[f"gpu_{workers}"][k] for k in ("decode", "workers", "compile", "gpu_decoder")] == [
        "gpu", workers, True, "torchvision"]
    targets = {t["target"]: t for t in redo[-2]["targets"]}
    assert targets[f"gpu_{workers} compiled >= 0.95 of the compiled limit"]["figure"] == round(
        rates[f"gpu_{workers}"]["images_per_sec"] / rates["limit"]["images_per_sec"], 3)
    (restart,) = [line for line in redo if "restart" in line and "first_step_s" in line]
    assert restart["first_step_s"] is not None and restart["first_step_s"] <= restart["after_checkpoint_s"]
    (tests,) = [line for line in redo if "tests" in line]
    assert tests["failed"] == [] and "skipped" in tests["summary"]  # no CUDA device here: every CUDA test skips
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                    if CUDA_MARK.search(p.read_text()))
    assert {"tests/checkpoint/test_saving.py", "tests/gpu/test_cuda.py",
            "tests/gpu/test_micro_batch_cuda.py"} <= set(marked)
    assert tests["tests"].split() == marked  # every module that holds a CUDA test, whichever they are

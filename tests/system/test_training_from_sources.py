"""Training from each form ImageNet is held in: a pack (`imagenet-elastic pack`), shards written by the webdataset
package's own writer, Hugging Face parquet files read in place, and class folders with a flat, labelled val folder.
A run on any of them is bitwise the run on the class folders they hold; a SIGKILLed torchrun job restarts, resumes
at another world size and evaluates from them exactly as from the folders."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import (
    SMALL_RUN,
    assert_same_tensors,
    child_env,
    load_checkpoint,
    run_and_kill,
    torchrun_cmd,
    torchrun_worker,
)
from inprocess import evaluate, train
from makers import flatten, hub_folder, run_pack, wds_shards

from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.report.metrics import read as read_metrics

RUN = [*SMALL_RUN, "--workers", "0", "--threads", "1", "--max-steps-per-epoch", "3", "--global-batch-size", "16"]
FORMS = ("pack", "webdataset", "parquet", "flat val")


@pytest.fixture(scope="module")
def forms(image_folder, tmp_path_factory) -> dict[str, list[str]]:
    """DATA (and val options) of each form, made from the fixture's class folders."""
    root = tmp_path_factory.mktemp("forms")
    run_pack(str(image_folder), str(root / "pack"), "--shard-size", "20")
    for split in ("train", "val"):
        wds_shards(image_folder / split, root / "wds" / split, per_shard=25)
    classes = scan_image_folder(str(image_folder / "train"), "train").classes
    (root / "wds" / "classes.txt").write_text("".join(f"{c}\n" for c in classes))
    hub_folder(image_folder, root / "hub", rows_per_group=10)
    rows = flatten(image_folder, root / "flat")
    (root / "labels.csv").write_text("".join(f"{name},{cls}\n" for name, cls in rows))
    return {"pack": [str(root / "pack")], "webdataset": [str(root / "wds")], "parquet": [str(root / "hub")],
            "flat val": [str(image_folder), "--val-path", str(root / "flat"), "--val-labels", str(root / "labels.csv")]}


@pytest.fixture(scope="module")
def folder_run(image_folder, tmp_path_factory):
    """Two epochs on the class folders at world size 1 (micro-batches of 8, global batch 16)."""
    ckpt = tmp_path_factory.mktemp("folder_run")
    train([str(image_folder), *RUN, "--epochs", "2", "--checkpoints-path", str(ckpt)])
    return ckpt


@pytest.mark.parametrize("form", FORMS)
def test_a_run_on_each_form_is_bitwise_the_run_on_its_class_folders(forms, folder_run, tmp_path, form):
    outcome = train([*forms[form], *RUN, "--epochs", "2", "--checkpoints-path", str(tmp_path)])
    assert outcome.final_step == 6
    ours, reference = load_checkpoint(tmp_path / "last.pt"), load_checkpoint(folder_run / "last.pt")
    assert_same_tensors(ours["model"], reference["model"])
    assert ours["classes"] == reference["classes"]
    keys = ("val_loss", "val_top1", "val_top5", "val_samples")
    assert [[r[k] for k in keys] for r in ours["history"]] == [[r[k] for k in keys] for r in reference["history"]]


@pytest.fixture(scope="module")
def killed_jobs(forms, warm_python, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """Each form's two-rank job (the start-up check compares their sources), rank 1 SIGKILLed in epoch 1 and
    restarted by torchrun; the four side by side: (checkpoints folder, exit code, output). The ranks (sixteen, with
    the restarted ones) are forks of one interpreter that imported torch once (tests/warm_python.py)."""
    base = tmp_path_factory.mktemp("killed")

    def killed(form: str, env: dict[str, str]) -> tuple[Path, int, str]:
        ckpt = base / str(FORMS.index(form)) / "ckpt"
        cmd = torchrun_cmd(2, *forms[form], *SMALL_RUN, "--threads", "1", "--max-steps-per-epoch", "3", "--epochs",
                           "1", "--checkpoint-interval", "1", "--checkpoints-path", str(ckpt), restarts=1)
        return (ckpt, *run_and_kill(cmd, when="epoch 1/1 step 2/", victim=torchrun_worker(1), env=env))

    with ThreadPoolExecutor(len(FORMS)) as pool:
        jobs = {form: pool.submit(killed, form, child_env(PYTHON_EXEC=warm_python)) for form in FORMS}
    return {form: job.result() for form, job in jobs.items()}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("form", FORMS)
def test_a_sigkilled_torchrun_job_resumes_at_another_world_size_and_evaluates_as_from_folders(
        forms, folder_run, killed_jobs, tmp_path, form):
    """The job of `killed_jobs` restarted and ended; epoch 2 at world size 1 from its checkpoint; then --evaluate of
    it. Every weight is the class folders' run's, and the evaluation is the epoch's metrics row."""
    ckpt, code, output = killed_jobs[form]
    assert code == 0, output
    assert "every rank has the same data" in output and re.search(r"resuming from .*last\.pt", output), output
    train([*forms[form], *RUN, "--epochs", "2", "--checkpoints-path", str(ckpt), "--resume"])
    final, reference = load_checkpoint(ckpt / "last.pt"), load_checkpoint(folder_run / "last.pt")
    assert final["world_size"] == 1 and [r["world_size"] for r in final["history"]] == [2, 1]
    assert_same_tensors(final["model"], reference["model"])
    scratch = tmp_path / "eval"
    shutil.rmtree(scratch, ignore_errors=True)
    scores = evaluate([*forms[form], *RUN, "--evaluate", "--resume", str(ckpt / "last.pt"),
                       "--checkpoints-path", str(scratch)])
    row = read_metrics(ckpt / "metrics.jsonl")[-1]
    assert (scores["val_top1"], scores["val_samples"]) == (row["val_top1"], row["val_samples"]), json.dumps(row)


def test_decode_gpu_reads_a_packs_bytes_as_it_reads_the_folders(forms, image_folder, tmp_path):
    """--decode gpu hands the shard's bytes to the device decoder (the CPU device here), with the choices its
    workers drew: the pack trains the weights the class folders train under --decode gpu."""
    for name, data in (("pack", forms["pack"]), ("folder", [str(image_folder)])):
        train([*data, *RUN, "--epochs", "1", "--decode", "gpu", "--auto-augment", "ta_wide", "--checkpoints-path",
               str(tmp_path / name)])
    assert_same_tensors(load_checkpoint(tmp_path / "pack" / "last.pt")["model"],
                        load_checkpoint(tmp_path / "folder" / "last.pt")["model"])

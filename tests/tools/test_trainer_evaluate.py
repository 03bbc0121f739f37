"""The trainer's `--evaluate` (tools/evaluate.py's evaluate_checkpoint): a front of the evaluate tool's one code path
that scores a checkpoint as its run validated it: the raw weights and their average in one pass, under the trainer's
metric names; out-of-memory batches halved once under --micro-batch auto; a Ctrl-C that says nothing was written."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_RUN, assert_names, load_checkpoint
from inprocess import command, evaluate, in_memory, train
from torch import nn

from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.errors import UserError
from imagenet_elastic.tools import evaluate as evaluate_tool
from imagenet_elastic.train.micro_batch import MicroBatches, OutOfMemoryAgain
from imagenet_elastic.train.step import evaluate as score_batches

NOWHERE = "/nonexistent-data"  # DATA is not read when the splits are given


def args(folder, *extra: str) -> list[str]:
    return [NOWHERE, *SMALL_RUN, "--workers", "0", "--threads", "1", "--epochs", "2", "--max-steps-per-epoch", "3",
            "--checkpoints-path", str(folder), *extra]


@pytest.fixture(scope="module")
def averaged(tmp_path_factory):
    """A run with --model-ema on images in memory: its checkpoints keep the weights and their average."""
    splits = in_memory(classes=4, train_per_class=12, val_per_class=5)
    folder = tmp_path_factory.mktemp("ema")
    outcome = train(args(folder, "--model-ema", "--model-ema-decay", "0.5"), splits=splits)
    assert not outcome.stopped
    return folder, splits


def test_evaluate_scores_the_weights_and_their_average_as_the_run_validated_them(averaged, tmp_path):
    folder, splits = averaged
    row = load_checkpoint(folder / "last.pt")["history"][-1]
    scores = evaluate([*args(tmp_path), "--evaluate", "--resume", str(folder / "last.pt")], splits=splits)
    assert scores["checkpoint"] == str(folder / "last.pt")
    for name in ("val_top1", "val_top5", "val_samples", "val_top1_ema", "val_top5_ema"):
        assert scores[name] == row[name], name
    assert scores["val_loss"] == pytest.approx(row["val_loss"], rel=1e-6)
    assert scores["val_loss_ema"] == pytest.approx(row["val_loss_ema"], rel=1e-6)
    assert scores["val_loss_ema"] != scores["val_loss"]  # two models were scored, not one twice


@pytest.mark.parametrize("native_bf16", [False, True])
def test_evaluate_warns_of_another_amp_only_where_it_resolves_to_another_precision(averaged, tmp_path, capsys,
                                                                                    monkeypatch, native_bf16):
    """The run trained with --amp none; auto is fp32 as well on a CPU without native bf16, bf16 on one with it."""
    folder, splits = averaged
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    evaluate([*args(tmp_path), "--amp", "auto", "--evaluate", "--resume", str(folder / "last.pt")], splits=splits)
    warned = [line for line in capsys.readouterr().err.splitlines() if "amp:" in line]
    assert len(warned) == native_bf16 and all("'none' (fp32" in line and "(bf16)" in line for line in warned), warned


def test_ctrl_c_during_evaluate_says_nothing_was_written_and_exits_130(averaged, tmp_path, monkeypatch):
    folder, (_, val) = averaged
    for i, (image, label) in enumerate(zip(val.images, val.labels)):  # the val split in class folders
        (tmp_path / "val" / val.classes[label]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "val" / val.classes[label] / f"{i}.jpg").write_bytes(image)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_tool, "score", interrupted)
    done = command([str(tmp_path / "nowhere"), "--evaluate", "--resume", str(folder / "last.pt"), "--val-path",
                    str(tmp_path / "val"), "--checkpoints-path", str(tmp_path / "ck")])
    assert done.returncode == 130, done.stderr
    assert "Ctrl-C: --evaluate stopped, nothing written" in done.stdout + done.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_weight_average_edited_to_another_shape_is_one_line_naming_the_checkpoint(averaged, tmp_path):
    folder, splits = averaged
    snapshot = load_checkpoint(folder / "last.pt")
    snapshot["model_ema"]["fc.bias"] = torch.zeros(7)
    torch.save(snapshot, tmp_path / "edited.pt")
    with pytest.raises(UserError) as caught:
        evaluate([*args(tmp_path / "ck"), "--evaluate", "--resume", str(tmp_path / "edited.pt")], splits=splits)
    assert_names(str(caught.value), tmp_path / "edited.pt", "'model_ema'", "fc.bias")


class RunsOutOfMemoryAbove(nn.Module):
    """A model that raises CUDA's out-of-memory error on a batch of more than `most` images."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.most = most
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.most:
            raise torch.OutOfMemoryError(f"tried to allocate for {len(x)} images")
        return self.head(x)


def test_under_micro_batch_auto_a_batch_out_of_memory_is_scored_in_halves_once_with_the_same_scores():
    torch.manual_seed(0)
    model, to = RunsOutOfMemoryAbove(most=3), ModelInput(torch.device("cpu"), None, channels_last=False)
    generator = torch.Generator().manual_seed(1)
    batches = [Batch(torch.randint(0, 256, (n, 4, 4, 3), dtype=torch.uint8, generator=generator),
                     torch.randint(0, 5, (n,), generator=generator)) for n in (6, 5, 2)]
    warnings: list[str] = []
    fit = MicroBatches(BatchPlan(6, 1, 6), 6, 0, auto=True, warn=warnings.append)  # as evaluate_checkpoint's
    halved = score_batches(to, model, batches, fit=fit)
    model.most = 100
    whole = score_batches(to, model, batches)
    assert (halved.samples, halved.top1, halved.top5) == (whole.samples, whole.top1, whole.top5) == (
        13, whole.top1, whole.top5)
    assert halved.loss == pytest.approx(whole.loss, rel=1e-6)
    assert fit.validation_batch == 3 and len(warnings) == 1 and "batches of 3" in warnings[0]
    model.most = 1
    with pytest.raises(OutOfMemoryAgain, match="halved once already"):
        score_batches(to, model, batches, fit=fit)


def test_ranks_scoring_prints_differ_when_one_weight_or_one_label_differs(averaged):
    """What check_same_scoring gathers across ranks: equal for the same model and set, and apart when a single
    weight of the model, or a single label of the set, differs."""
    _, splits = averaged
    val = splits[1]
    model = nn.Linear(3, 2)
    same = evaluate_tool.scoring_print({"": model}, [("val", val, None)])
    assert evaluate_tool.scoring_print({"": model}, [("val", val, None)]) == same
    with torch.no_grad():
        model.weight[1, 2] += 1e-3
    assert evaluate_tool.scoring_print({"": model}, [("val", val, None)])[1] != same[1]
    relabelled = type(val)(val.role, val.classes, val.images, val.labels[::-1].copy())
    assert evaluate_tool.scoring_print({"": model}, [("val", relabelled, None)])[2] != same[2]

"""A model timm builds for one input size (ViT, DeiT: `fixed_input_size`) at the run's --image-size and
--val-crop-size: built for them where timm can (`img_size`, and `dynamic_img_size` for a second size), its
published weights resampled, its checkpoint rebuilt at that size by resume, export, evaluate and --teacher; where
timm cannot, one line naming the model, its size and the flag, before the data is read. In this process, on splits
held in memory (tests/inprocess.py)."""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import load_checkpoint
from inprocess import command, in_memory, train
from makers import cached, timm_model

from imagenet_elastic.models import teacher_weights
from imagenet_elastic.tools.evaluate import load_model
from imagenet_elastic.tools.export import export

RUN = ["unused", "--batch-size", "8", "--workers", "0", "--threads", "1", "--log-interval", "1",
       "--warmup-epochs", "1", "--lr", "0.1", "--amp", "none", "--max-steps-per-epoch", "1"]
DEIT = "deit_tiny_distilled_patch16_224"


def run(folder, *extra: str, epochs: int = 1, resume: bool = False):
    """A one-step epoch per epoch, the model it ended with, and its weights before the first step."""
    seen = {}

    def keep(trainer) -> None:
        weights = trainer.state.model.state_dict()
        seen.update(model=trainer.state.model, start={k: v.clone() for k, v in weights.items()})

    argv = [*RUN, "--checkpoints-path", str(folder), "--epochs", str(epochs), *extra, *(["--resume"] if resume else [])]
    outcome = train(argv, before_fit=keep, splits=in_memory())
    return outcome, seen["model"], seen["start"]


@pytest.mark.parametrize(("model", "extra", "tokens"), [
    (DEIT, ["--image-size", "32"], 2 + 2 * 2),  # class and distillation tokens, a 2x2 grid of patches
    ("vit_tiny_patch16_224", ["--image-size", "32"], 1 + 2 * 2),
    (DEIT, ["--image-size", "32", "--val-crop-size", "48"], 2 + 3 * 3),  # made for validation's 48, trains at 32
])
def test_a_fixed_size_vit_trains_and_validates_at_the_runs_image_size(tmp_path, model, extra, tokens):
    outcome, trained, _ = run(tmp_path, "--model", model, *extra)
    assert outcome.final_step == 1
    assert trained.pos_embed.shape[1] == tokens
    assert load_checkpoint(tmp_path / "last.pt")["history"][0]["val_top1"] >= 0  # validated at its crop


@pytest.mark.parametrize(("model", "extra", "named"), [
    ("efficientformer_l1", ["--image-size", "32"],
     "takes 224 px images only: timm cannot build it for --image-size 32"),
    ("mixer_s16_224", ["--image-size", "32", "--val-crop-size", "48"],
     "can be made for --val-crop-size 48 but then not for --image-size 32"),
    ("test_vit", ["--image-size", "33"], "multiples of its 16 px patches: timm cannot build it for --image-size 33; "
     "pass --image-size 32 or 48"),
    ("test_vit", ["--image-size", "32", "--val-crop-size", "40"], "multiples of its 16 px patches: timm cannot "
     "build it for --val-crop-size 40; pass --val-crop-size 32 or 48"),
])
def test_a_model_timm_cannot_build_for_the_runs_sizes_is_one_line_before_the_data_is_read(tmp_path, model, extra,
                                                                                         named):
    finished = command([*RUN, "--model", model, *extra, "--checkpoints-path", str(tmp_path / "ckpt")])
    assert finished.returncode == 2 and len(finished.stderr.strip().splitlines()) == 1, finished.stderr
    assert f"--model {model} " in finished.stderr and named in finished.stderr
    assert not (tmp_path / "ckpt").exists()  # DATA, `unused`, was never asked for


def test_published_weights_of_a_fixed_size_vit_are_resampled_to_the_runs_size(hub, tmp_path):
    """timm's test_vit3 takes 160 px only (a 10x10 grid): at 32 px its position embeddings are resampled to 2x2 by
    timm's loader, every other weight as published."""
    published = cached(hub, "someone/vit3", timm_model("test_vit3", 4, seed=3))
    outcome, _, weights = run(tmp_path, "--model", "hf-hub:someone/vit3", "--pretrained", "--image-size", "32")
    assert outcome.final_step == 1 and published["pos_embed"].shape[1] == 1 + 10 * 10
    assert weights["pos_embed"].shape[1] == 1 + 2 * 2
    assert torch.equal(weights["patch_embed.proj.weight"], published["patch_embed.proj.weight"])


@pytest.fixture(scope="module")
def small_deit(tmp_path_factory):
    """A DeiT trained one step at 32 px, validated at 32."""
    folder = tmp_path_factory.mktemp("deit32")
    run(folder, "--model", DEIT, "--image-size", "32")
    return folder


def test_a_checkpoint_of_a_vit_made_for_its_size_is_rebuilt_so_by_export_evaluate_and_teacher(small_deit, tmp_path):
    saved = load_checkpoint(small_deit / "last.pt")["model"]
    images = torch.rand(2, 3, 32, 32)
    export(str(small_deit / "last.pt"), str(tmp_path / "export"), ema=False)
    exported = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True).eval()  # timm alone
    assert torch.equal(exported.pos_embed, saved["pos_embed"]) and exported(images).shape == (2, 4)
    evaluated, own = load_model(str(small_deit / "last.pt"), pretrained=False, ema=False)
    assert own.crop == 32 and torch.equal(evaluated.model.pos_embed, saved["pos_embed"])
    teacher = teacher_weights.read(str(small_deit / "last.pt"))
    assert teacher.input.size == (32, 32) and teacher.model.eval()(images).shape == (2, 4)


def test_a_resume_at_another_val_crop_keeps_the_size_the_weights_were_made_for(small_deit, tmp_path):
    import shutil

    shutil.copytree(small_deit, tmp_path / "run")
    outcome, model, _ = run(tmp_path / "run", "--model", DEIT, "--image-size", "32", "--val-crop-size", "48", epochs=2,
                         resume=True)
    assert outcome.final_step == 2 and model.pos_embed.shape[1] == 2 + 2 * 2  # still the 32 px grid, resampled at 48

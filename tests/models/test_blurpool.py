"""--blurpool (FFCV's BlurPool): which convolutions blur their input, that the blur is the binomial filter, that
the state dict stays the plain model's, and that a checkpoint is resumed, evaluated and exported only with it."""

from __future__ import annotations

import json

import inprocess
import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import SMALL_RUN, assert_names, assert_row_describes, evaluate_checkpoint, expect_user_error
from torch import nn

from imagenet_elastic.errors import UserError
from imagenet_elastic.models.blurpool import blur_strided_convs
from imagenet_elastic.models.create import create_ema, create_model
from imagenet_elastic.report.metrics import read as read_metrics
from imagenet_elastic.tools.export import BLURPOOL_CALL
from imagenet_elastic.tools.export import main as export_main


def test_blur_goes_before_each_strided_convolution_of_16_or_more_input_channels():
    """FFCV's rule on ResNet-50: the 3x3 and the shortcut of each stage's first block; not the RGB stem."""
    assert blur_strided_convs(create_model("resnet50", 10)) == [
        "layer2.0.conv2", "layer2.0.downsample.0", "layer3.0.conv2", "layer3.0.downsample.0", "layer4.0.conv2",
        "layer4.0.downsample.0"]
    model = create_model("test_resnet", 4, blurpool=True)
    assert blur_strided_convs(model) == []  # already blurred: a second call adds nothing


def binomial_blur(x: torch.Tensor) -> torch.Tensor:
    """[1 2 1] x [1 2 1] / 16 on each channel, zero padding: FFCV's filter, written out here."""
    row = torch.tensor([1.0, 2.0, 1.0])
    kernel = (row[:, None] * row[None, :] / 16).expand(x.shape[1], 1, 3, 3)
    return F.conv2d(x, kernel, padding=1, groups=x.shape[1])


def test_a_blurred_convolution_convolves_the_binomially_blurred_input():
    torch.manual_seed(0)
    conv = create_model("resnet50", 10, blurpool=True).layer3[0].conv2
    plain = nn.Conv2d(256, 256, 3, stride=2, padding=1, bias=False)
    plain.load_state_dict(conv.state_dict())
    x = torch.randn(2, 256, 14, 14)
    expected = F.conv2d(binomial_blur(x), conv.weight, None, conv.stride, conv.padding)
    torch.testing.assert_close(conv(x), expected)
    assert not torch.allclose(plain(x), expected, atol=1e-3)
    cl = conv.to(memory_format=torch.channels_last)(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(cl, expected, rtol=1e-4, atol=1e-4)


def scrambled(model: nn.Module) -> nn.Module:
    """Random weights everywhere: timm zero-initialises each block's last norm, which hides the blur of its branch."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


def test_the_state_dict_is_the_plain_models_and_the_average_blurs_too():
    torch.manual_seed(0)
    blurred, plain = create_model("test_resnet", 4, blurpool=True), scrambled(create_model("test_resnet", 4))
    assert blurred.state_dict().keys() == plain.state_dict().keys()
    blurred.load_state_dict(plain.state_dict())
    blurred.eval(), plain.eval()
    x = torch.randn(2, 3, 32, 32)
    assert not torch.allclose(blurred(x), plain(x), atol=1e-4)
    ema = create_ema(blurred, 0.99, warmup=False).module.eval()  # a deep copy: its own filters, the same blur
    torch.testing.assert_close(ema(x), blurred(x))


def test_a_model_with_nothing_to_blur_is_refused_by_name():
    with pytest.raises(UserError) as caught:
        create_model("vit_tiny_patch16_224", 4, blurpool=True)
    assert_names(str(caught.value), "--blurpool", "vit_tiny_patch16_224", "strided convolution", "16")


def test_a_run_resumes_and_evaluates_only_as_the_model_it_trained_and_fine_tuning_says_so(image_folder, tmp_path):
    ckpt = tmp_path / "ckpt"
    trained = inprocess.command([str(image_folder), *SMALL_RUN, "--workers", "0", "--blurpool", "--epochs", "2",
                                 "--max-steps-per-epoch", "2", "--checkpoints-path", str(ckpt)])
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "BlurPool before 3 strided convolutions" in trained.stdout
    row = read_metrics(ckpt / "metrics.jsonl")[-1]
    assert_row_describes(row, evaluate_checkpoint(image_folder, ckpt / "last.pt", 1, tmp_path / "e", "--blurpool"))
    # --evaluate takes the blur from the checkpoint; said otherwise, one line naming the flag, exit 2, and the
    # checkpoints folder as it was (test_bad_input's check)
    assert_row_describes(row, evaluate_checkpoint(image_folder, ckpt / "last.pt", 1, tmp_path / "e1"))
    expect_user_error([str(image_folder), *SMALL_RUN, "--evaluate", "--no-blurpool", "--resume",
                       str(ckpt / "last.pt"), "--checkpoints-path", str(tmp_path / "e2")],
                      (f"checkpoint {ckpt / 'last.pt'}", "--blurpool", "--blurpool"), ckpt)  # its blur; the remedy
    expect_user_error([str(image_folder), *SMALL_RUN, "--epochs", "3", "--max-steps-per-epoch", "2", "--resume",
                       "--checkpoints-path", str(ckpt)], "pass --blurpool", ckpt)
    tuned = inprocess.command([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1",
                               "--max-steps-per-epoch", "1", "--initial-checkpoint", str(ckpt / "last.pt"),
                               "--checkpoints-path", str(tmp_path / "t")])
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr  # fine-tuning without the blur is allowed, and said
    said = [line for line in tuned.stderr.splitlines() if "--initial-checkpoint" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), tuned.stderr  # one warning: the file, and its blur
    assert_names(said[0], "--initial-checkpoint", ckpt / "last.pt", "--blurpool")


def test_the_export_says_how_to_give_timms_model_its_blur_back(tmp_path, capsys):
    torch.manual_seed(0)
    model = scrambled(create_model("test_resnet", 3, blurpool=True)).eval()
    torch.save({"model": model.state_dict(), "model_ema": None, "epoch": 4, "model_name": "test_resnet",
                "classes": ["a", "b", "c"], "best_of": "model", "optimizer": {},
                "config": {"image_size": 32, "blurpool": True}}, tmp_path / "best.pt")
    export_main([str(tmp_path / "best.pt"), str(tmp_path / "out")])
    assert BLURPOOL_CALL in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["imagenet_elastic"] == {"blurpool": True, "after_loading": BLURPOOL_CALL}
    rebuilt = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(rebuilt(x), model(x), atol=1e-4)  # timm alone builds no blur
        exec(BLURPOOL_CALL, {"model": rebuilt})  # what the export told the user to run
        torch.testing.assert_close(rebuilt(x), model(x))


def test_torch_compile_of_a_blurred_model_after_a_plain_one_still_blurs():
    """dynamo may reuse the graph of a model of the same classes: the blur must show in the classes, not only
    in hooks that dynamo does not guard on (with a forward pre-hook, the second model ran unblurred)."""
    x = torch.randn(2, 3, 32, 32)
    torch._dynamo.reset()
    try:
        for blurpool in (False, True):
            torch.manual_seed(0)
            model = scrambled(create_model("test_resnet", 4, blurpool=blurpool)).eval()
            with torch.no_grad():
                torch.testing.assert_close(torch.compile(model, backend="eager")(x), model(x))
    finally:
        torch._dynamo.reset()

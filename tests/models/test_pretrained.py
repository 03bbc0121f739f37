"""--pretrained starts a fresh run from exactly the weights timm publishes for --model, read offline from a Hugging
Face hub cache (or a local-dir: folder) the test writes; a classifier of another class count is re-initialised;
a resume needs none of it; weights missing offline are one line. --layer-decay and --grad-checkpointing runs resume
bitwise, and --grad-checkpointing trains the same numbers as without it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import assert_names, assert_same_tensors, child_env, load_checkpoint, python_cmd
from inprocess import command, in_memory, train
from makers import cached, publish, timm_model

RUN = ["unused", "--image-size", "32", "--batch-size", "8", "--workers", "0", "--threads", "1", "--log-interval", "1",
       "--warmup-epochs", "1", "--lr", "0.5", "--amp", "none", "--epochs", "1", "--max-steps-per-epoch", "1"]


def built_weights(argv: list[str], splits=None) -> tuple[dict[str, torch.Tensor], str]:
    """The weights the run starts from (before its first step), and what the start-up table says of them."""
    seen = {}

    def keep(trainer) -> None:
        seen["weights"] = {k: v.clone() for k, v in trainer.state.model.state_dict().items()}
        seen["start"] = trainer.training.start

    train(argv, before_fit=keep, splits=splits or in_memory())
    return seen["weights"], seen["start"]


def assert_starts_from(weights: dict, published: dict, reinitialised: set[str]) -> None:
    assert weights.keys() == published.keys()
    for key, value in published.items():
        if key in reinitialised:
            assert weights[key].shape != value.shape, key
        else:
            assert torch.equal(weights[key], value), key


def test_a_pretrained_tag_starts_from_the_cached_files_weights_with_a_new_classifier(hub, tmp_path):
    published = cached(hub, "timm/test_resnet.r160_in1k", timm_model("test_resnet", 1000, seed=7))
    weights, start = built_weights([*RUN, "--model", "test_resnet", "--pretrained",
                                    "--checkpoints-path", str(tmp_path / "ckpt")])
    assert_starts_from(weights, published, {"fc.weight", "fc.bias"})
    assert weights["fc.weight"].shape[0] == 4
    assert "timm/test_resnet.r160_in1k" in start and str(hub) in start
    assert "classifier re-initialised: 1000 classes there, 4 here" in start
    settings = load_checkpoint(tmp_path / "ckpt" / "last.pt")["config"]
    assert settings["pretrained"] and settings["model"] == "test_resnet"


def test_an_hf_hub_name_of_the_same_class_count_starts_from_every_weight(hub, tmp_path):
    published = cached(hub, "someone/shapes-resnet", timm_model("test_resnet", 4, seed=8))
    weights, start = built_weights([*RUN, "--model", "hf-hub:someone/shapes-resnet", "--pretrained",
                                    "--checkpoints-path", str(tmp_path / "ckpt")])
    assert_starts_from(weights, published, set())
    assert "someone/shapes-resnet" in start and "re-initialised" not in start


def test_a_local_dir_export_folder_is_published_weights_too(hub, tmp_path):
    published = publish(tmp_path / "export", timm_model("test_vit", 6, seed=9))
    weights, start = built_weights([*RUN, "--model", f"local-dir:{tmp_path / 'export'}", "--pretrained",
                                    "--checkpoints-path", str(tmp_path / "ckpt")])
    assert_starts_from(weights, published, {"head.weight", "head.bias"})
    assert "6 classes there, 4 here" in start


def test_a_headless_model_is_published_weights_with_a_new_classifier_not_a_re_initialised_one(hub, tmp_path):
    published = publish(tmp_path / "export", timm_model("test_resnet", 0, seed=10))  # a feature extractor
    weights, start = built_weights([*RUN, "--model", f"local-dir:{tmp_path / 'export'}", "--pretrained",
                                    "--checkpoints-path", str(tmp_path / "ckpt")])
    assert_starts_from({k: v for k, v in weights.items() if k in published}, published, set())
    assert sorted(set(weights) - set(published)) == ["fc.bias", "fc.weight"] and weights["fc.weight"].shape[0] == 4
    assert start == f"published: {tmp_path / 'export'} (headless: a new classifier for 4 classes)"


def test_a_resumed_run_continues_bitwise_from_its_checkpoint_without_the_published_weights(hub, tmp_path):
    cached(hub, "timm/test_resnet.r160_in1k", timm_model("test_resnet", 1000, seed=7))
    argv = [*RUN, "--model", "test_resnet", "--pretrained", "--epochs", "2"]
    assert train([*argv, "--checkpoints-path", str(tmp_path / "straight")], splits=in_memory()).final_step == 2
    stopped = [*argv, "--checkpoints-path", str(tmp_path / "stopped")]
    assert train(stopped, signal_during_step=1, splits=in_memory()).stopped
    shutil.rmtree(hub / "models--timm--test_resnet.r160_in1k")  # the cache is gone (another node, a cleanup)
    resumed = train([*stopped, "--resume"], splits=in_memory())
    assert not resumed.stopped and resumed.final_step == 2
    assert_same_tensors(load_checkpoint(tmp_path / "stopped" / "last.pt")["model"],
                        load_checkpoint(tmp_path / "straight" / "last.pt")["model"])


def test_a_pretrained_tag_without_pretrained_warns_once_that_a_fresh_run_starts_from_random_weights(tmp_path, capsys):
    argv = [*RUN, "--model", "test_resnet.r160_in1k", "--checkpoints-path", str(tmp_path / "ckpt")]
    assert built_weights(argv)[1] == "random (seed)"  # as before: only the warning is new
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert_names(line, "test_resnet.r160_in1k", "--pretrained", "random")
    train([*argv, "--resume", "--epochs", "2"], splits=in_memory())  # its own checkpoint's weights: nothing to say
    train([*RUN, "--model", "test_resnet", "--checkpoints-path", str(tmp_path / "untagged")], splits=in_memory())
    assert "--pretrained" not in capsys.readouterr().err


def one_line_error(argv: list[str]) -> str:
    finished = command(argv)
    assert finished.returncode == 2, finished.stdout + finished.stderr
    lines = [line for line in finished.stderr.strip().splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and "Traceback" not in finished.stderr, finished.stderr
    return lines[0]


def test_published_weights_missing_offline_are_one_line_naming_the_model_and_the_cache(hub, tmp_path):
    (tmp_path / "data").mkdir()  # no class folders: the data would be refused, had it been read first
    line = one_line_error([str(tmp_path / "data"), "--model", "test_vit", "--pretrained",
                           "--checkpoints-path", str(tmp_path / "ckpt")])
    assert "test_vit" in line and str(hub) in line and "HF_HUB_OFFLINE" in line
    assert not (tmp_path / "ckpt").exists()


def test_hf_home_and_hf_hub_offline_are_read_from_the_environment(tmp_path):
    """huggingface_hub reads them as it is imported: a process of its own, started with them set."""
    (tmp_path / "data").mkdir()
    env = {k: v for k, v in child_env(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1").items()
           if k != "HF_HUB_CACHE"}  # which would override HF_HOME
    result = subprocess.run(python_cmd(str(tmp_path / "data"), "--model", "test_resnet", "--pretrained",
                                       "--checkpoints-path", str(tmp_path / "ckpt")),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert f"the Hugging Face cache {tmp_path / 'home' / 'hub'} and HF_HUB_OFFLINE is set" in result.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(("extra", "culprit"), [
    (["--pretrained", "--initial-checkpoint", "w.pt"], "--pretrained and --initial-checkpoint"),
    (["--model", "hf-hub:someone/shapes"], "--model hf-hub:someone/shapes names published weights: add --pretrained"),
    (["--model", "test_resnet.no_such_tag", "--pretrained"], "test_resnet.no_such_tag"),
    (["--model", "test_resnet.no_such_tag"], "tag 'no_such_tag' of test_resnet"),  # without --pretrained too
    (["--model", "hf-hub:a/b/c", "--pretrained"], "--pretrained --model hf-hub:a/b/c"),  # a pasted path or URL
    (["--teacher", "hf-hub:timm/resnet18.a1_in1k/tree/main"], "--teacher hf-hub:timm/resnet18.a1_in1k/tree/main"),
    (["--initial-checkpoint", ""], "--initial-checkpoint is empty"),  # a script's unset variable
    (["--teacher", ""], "--teacher is empty"),
    (["--model", "vgg11", "--grad-checkpointing"], "--grad-checkpointing: timm's vgg11 does not support"),
    (["--model", "ghostnet_050", "--drop-path", "0.1"], "--drop-path: timm's ghostnet_050 has no drop_path_rate"),
    (["--model", "vit_tiny_patch16_224", "--blurpool"], "--blurpool: timm's vit_tiny_patch16_224 has no strided"),
])
def test_weights_asked_for_in_a_way_that_cannot_work_are_one_line(hub, tmp_path, extra, culprit):
    (tmp_path / "data").mkdir()
    assert culprit in one_line_error([str(tmp_path / "data"), *extra, "--checkpoints-path", str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt").exists()


def test_grad_checkpointing_refuses_a_model_timm_cannot_checkpoint():
    from imagenet_elastic.errors import UserError
    from imagenet_elastic.models.create import recompute_activations

    with pytest.raises(UserError, match="--grad-checkpointing: timm's plain does not support"):
        recompute_activations(torch.nn.Linear(2, 2), "plain")


RESUMED = [*RUN, "--model", "test_resnet", "--epochs", "2", "--max-steps-per-epoch", "3", "--drop-path", "0.1"]


def final_checkpoint(folder: Path, *extra: str, stop_in_step: int = 0) -> dict:
    argv = [*RESUMED, *extra, "--checkpoints-path", str(folder)]
    if stop_in_step:
        assert train(argv, signal_during_step=stop_in_step, splits=in_memory()).stopped
        argv.append("--resume")
    assert train(argv, splits=in_memory()).final_step == 6
    return load_checkpoint(folder / "last.pt")


def test_grad_checkpointing_trains_the_same_numbers_and_resumes_bitwise(tmp_path):
    """Batch norm's running statistics included: the recomputation in the backward pass leaves them alone."""
    plain = final_checkpoint(tmp_path / "plain")
    recomputed = final_checkpoint(tmp_path / "recomputed", "--grad-checkpointing")
    assert_same_tensors(recomputed["model"], plain["model"])
    resumed = final_checkpoint(tmp_path / "resumed", "--grad-checkpointing", stop_in_step=4)
    assert_same_tensors(resumed["model"], plain["model"])
    assert_same_tensors(resumed["optimizer"]["state"], plain["optimizer"]["state"])


def test_layer_decay_scales_each_groups_lr_and_resumes_bitwise(tmp_path):
    extra = ("--layer-decay", "0.6", "--opt", "adamw", "--lr", "0.01")
    seen = {}
    argv = [*RESUMED, *extra, "--checkpoints-path", str(tmp_path / "straight")]

    def keep(trainer) -> None:
        seen.update(schedule=trainer.training.schedule, optimizer=trainer.state.optimizer)

    assert train(argv, before_fit=keep, splits=in_memory()).final_step == 6
    lr = seen["schedule"].at(5)  # the last step's
    scales = {g["lr_scale"] for g in seen["optimizer"].param_groups}
    assert len(scales) > 2 and max(scales) == 1.0
    for group in seen["optimizer"].param_groups:
        assert group["lr"] == lr * group["lr_scale"]
    straight = load_checkpoint(tmp_path / "straight" / "last.pt")
    resumed = final_checkpoint(tmp_path / "resumed", *extra, stop_in_step=4)
    assert_same_tensors(resumed["model"], straight["model"])
    assert_same_tensors(resumed["optimizer"]["state"], straight["optimizer"]["state"])


def test_a_folder_whose_config_json_names_no_timm_architecture_is_one_line_naming_it(hub, tmp_path):
    folder = tmp_path / "transformers_vit"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["ViTForImageClassification"], "model_type": "vit"}')
    (tmp_path / "data").mkdir()
    line = one_line_error([str(tmp_path / "data"), "--model", f"local-dir:{folder}", "--pretrained",
                           "--checkpoints-path", str(tmp_path / "ckpt")])
    assert_names(line, folder / "config.json", "architecture")


@pytest.mark.parametrize("edit", [
    lambda config: config.update(num_classes=10),  # timm drops the weights' classifier, builds one of 4
    lambda config: config["model_args"].update(num_classes=10),  # builds one of 10, drops the weights' 4
])
def test_an_export_whose_config_json_class_count_misfits_its_weights_is_refused_naming_both(tmp_path, edit):
    """Not a re-initialised classifier scored as if trained (`evaluate`, --teacher, --pretrained local-dir:)."""
    from imagenet_elastic.errors import UserError
    from imagenet_elastic.models.weights import load_weights

    folder = tmp_path / "export"
    publish(folder, timm_model("test_resnet", 4, seed=11))
    assert load_weights(str(folder), "MODEL").classes == 4
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as raised:
        load_weights(str(folder), "MODEL")
    assert_names(str(raised.value), folder, "10", folder / "model.safetensors", "4")

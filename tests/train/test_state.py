"""The training state a checkpoint holds: captured and applied exactly, refused when it is another run's."""

from __future__ import annotations

import io
import random
import shlex

import numpy as np
import pytest
import torch
from conftest import assert_names
from makers import CLASSES, make_state

from imagenet_elastic.checkpoint.store import load
from imagenet_elastic.errors import UserError
from imagenet_elastic.launch import distributed
from imagenet_elastic.models.create import create_ema
from imagenet_elastic.train.state import (
    EpochTally,
    PendingSteps,
    TrainState,
    apply_checkpoint,
    check_compatible,
    check_resumable,
)

# ----------------------------------------------------------------------------- TrainState

def take_optimizer_steps(state: TrainState, steps: int = 2) -> None:
    """Fill the SGD momentum buffers with made-up gradients (no forward pass: keeps the test fast)."""
    generator = torch.Generator().manual_seed(4)
    for _ in range(steps):
        for param in state.model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        state.optimizer.step()
    with torch.no_grad():  # and move a buffer, so buffers are checked too
        for name, buffer in state.model.named_buffers():
            if name.endswith("running_mean"):
                buffer.add_(0.5)


def round_trip(snapshot: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def with_scaler_at(state: TrainState, scale: float) -> TrainState:
    """An fp16 run's GradScaler that has moved: its scale and growth tracker are state to restore."""
    state.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    state.scaler.scale(torch.ones(()))
    state.scaler.update(scale)
    return state


def test_train_state_capture_and_apply_restore_everything_through_weights_only_load():
    original = with_scaler_at(make_state(seed=0), 1024.0)
    take_optimizer_steps(original)
    original.epoch, original.step, original.best_top1 = 3, 42, 61.5
    original.tally = EpochTally(samples=96, steps=6, loss_sum=7.25, seconds=3.5)  # mid-epoch: where it goes on
    original.history = [{"epoch": 1, "top1": 50.0}, {"epoch": 2, "top1": 61.5}]
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    snapshot = original.capture({"lr": 0.1}, {"model_name": "test_resnet", "classes": list(CLASSES)})
    expected = (torch.rand(4), random.random(), np.random.rand(3))

    loaded = round_trip(snapshot)
    assert loaded["model_name"] == "test_resnet" and loaded["config"] == {"lr": 0.1}

    restored = with_scaler_at(make_state(seed=1), 8.0)
    restored_keys = restored.model.state_dict().keys()
    assert any(not torch.equal(original.model.state_dict()[k], restored.model.state_dict()[k])
               for k in restored_keys)
    random.seed(0)
    np.random.seed(0)
    restored.apply(loaded)

    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]
    np.testing.assert_array_equal(np.random.rand(3), expected[2])
    for key, value in original.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[key], value), key
    original_opt, restored_opt = original.optimizer.state_dict(), restored.optimizer.state_dict()
    assert original_opt["param_groups"] == restored_opt["param_groups"]
    assert original_opt["state"].keys() == restored_opt["state"].keys() and original_opt["state"]
    for index, buffers in original_opt["state"].items():
        assert torch.equal(restored_opt["state"][index]["momentum_buffer"], buffers["momentum_buffer"])
    assert (restored.epoch, restored.step, restored.best_top1) == (3, 42, 61.5)
    assert restored.tally == original.tally and restored.tally is not original.tally
    assert restored.scaler.state_dict() == original.scaler.state_dict() and restored.scaler.get_scale() == 1024.0
    assert restored.history == original.history
    assert restored.history is not loaded["history"]


def test_a_gpu_checkpoints_fused_optimizer_kernel_does_not_follow_it_to_a_cpu_resume():
    gpu_run = make_state(seed=0)
    take_optimizer_steps(gpu_run)
    snapshot = round_trip(gpu_run.capture({}, {}))
    for group in snapshot["optimizer"]["param_groups"]:
        group["fused"] = True  # what create_optimizer sets on CUDA
    cpu_run = make_state(seed=1)
    cpu_run.apply(snapshot)
    assert [g["fused"] for g in cpu_run.optimizer.param_groups] == [None, None]
    assert [g["lr"] for g in cpu_run.optimizer.param_groups] == [g["lr"] for g in gpu_run.optimizer.param_groups]
    take_optimizer_steps(cpu_run, steps=1)  # and the restored momentum buffers still step


def test_train_state_apply_restores_the_random_number_generators():
    state = make_state(seed=0)
    random.seed(21)
    np.random.seed(22)
    torch.manual_seed(23)
    snapshot = round_trip(state.capture({}, {}))
    after_capture = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn())

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    torch.rand(7)
    state.apply(snapshot)
    after_apply = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn())

    assert torch.equal(after_apply[0], after_capture[0])
    assert after_apply[1] == after_capture[1]
    np.testing.assert_array_equal(after_apply[2], after_capture[2])
    assert after_apply[3] == after_capture[3]


def test_train_state_apply_with_a_cached_numpy_gaussian():
    state = make_state(seed=0)
    np.random.seed(5)
    np.random.randn()  # leaves a cached second gaussian in numpy's legacy state
    snapshot = round_trip(state.capture({}, {}))
    expected = np.random.randn(3)
    np.random.seed(6)
    state.apply(snapshot)
    np.testing.assert_array_equal(np.random.randn(3), expected)


# ----------------------------------------------------------------------------- check_compatible

def snapshot_of(model_name: str = "test_resnet", classes=CLASSES) -> dict:
    return {"model_name": model_name, "classes": list(classes)}


def test_check_compatible_accepts_the_same_model_and_classes():
    check_compatible(snapshot_of(), "/ck/last.pt", "test_resnet", CLASSES)


def test_check_compatible_refuses_another_model():
    with pytest.raises(UserError, match="of model 'resnet50', but --model is 'test_resnet'") as caught:
        check_compatible(snapshot_of(model_name="resnet50"), "/ck/last.pt", "test_resnet", CLASSES)
    assert_names(str(caught.value), "/ck/last.pt", "--model resnet50")  # the remedy last


def test_another_model_is_refused_with_its_runs_settings_file_as_the_remedy(tmp_path):
    """`--resume RUN/` without --model meets the default resnet50: the run's config.yaml carries its model."""
    (tmp_path / "config.yaml").write_text("model: test_resnet\n")
    with pytest.raises(UserError) as caught:
        check_compatible(snapshot_of(), str(tmp_path / "last.pt"), "resnet50", CLASSES)
    assert_names(str(caught.value), "'resnet50'", f"--config {tmp_path / 'config.yaml'}", "--model test_resnet")


def test_the_runs_settings_file_suggested_as_the_remedy_pastes_back_as_its_path(tmp_path):
    folder = tmp_path / "my run's $HOME"  # a space, a quote and a $: the shell would split or expand it bare
    folder.mkdir()
    (folder / "config.yaml").write_text("model: test_resnet\n")
    with pytest.raises(UserError) as caught:
        check_compatible(snapshot_of(), str(folder / "last.pt"), "resnet50", CLASSES)
    suggested = str(caught.value).split(" --config ", 1)[1].split(", its run's settings")[0]
    assert shlex.split(suggested) == [str(folder / "config.yaml")], suggested


def test_check_compatible_refuses_another_class_count():
    with pytest.raises(UserError, match="has 2 classes, the data has 3") as caught:
        check_compatible(snapshot_of(classes=("ant", "bee")), "/ck/last.pt", "test_resnet", CLASSES)
    assert "/ck/last.pt" in str(caught.value)


def test_check_compatible_refuses_other_class_names():
    with pytest.raises(UserError, match="other class names") as caught:
        check_compatible(snapshot_of(classes=("ant", "bee", "dog")), "/ck/last.pt", "test_resnet", CLASSES)
    assert "/ck/last.pt" in str(caught.value)


def test_a_checkpoint_of_another_optimizer_is_refused_for_training_but_not_for_evaluation():
    adamw = {**snapshot_of(), "config": {"opt": "adamw"}}
    with pytest.raises(UserError) as caught:
        check_compatible(adamw, "/ck/last.pt", "test_resnet", CLASSES, "sgd")
    assert_names(str(caught.value), "/ck/last.pt", "--opt adamw", "--opt sgd", "--opt adamw")  # the remedy last
    check_compatible(adamw, "/ck/last.pt", "test_resnet", CLASSES, "adamw")
    check_compatible(adamw, "/ck/last.pt", "test_resnet", CLASSES, None)  # weights only (--evaluate)
    check_compatible({**snapshot_of(), "config": {}}, "/ck/last.pt", "test_resnet", CLASSES, "sgd")  # before --opt


def test_a_checkpoint_of_a_newer_format_is_refused():
    with pytest.raises(UserError, match="format version 99"):
        check_compatible({**snapshot_of(), "format_version": 99}, "/ck/last.pt", "test_resnet", CLASSES)


def test_a_checkpoint_whose_settings_are_not_a_mapping_is_refused_naming_it():
    with pytest.raises(UserError, match="'config'") as caught:
        check_compatible({**snapshot_of(), "config": "lr: 0.1"}, "/ck/last.pt", "test_resnet", CLASSES)
    assert "/ck/last.pt" in str(caught.value)


# ----------------------------------------------------------------------------- check_resumable, apply_checkpoint

def saved_state() -> dict:
    return make_state(seed=0).capture({"lr": 0.1}, {"model_name": "test_resnet", "classes": list(CLASSES),
                                                    "world_size": 2, "global_batch": 16})


def test_a_checkpoint_the_trainer_wrote_is_resumable():
    check_resumable(saved_state(), "/ck/last.pt")


@pytest.mark.parametrize(("key", "value"), [
    ("epoch", "3"), ("epoch", -2), ("step", True), ("best_top1", "a"), ("history", 5), ("history", [1]),
    ("rng", {}), ("world_size", 0), ("global_batch", 0), ("scaler", 5), ("epoch_progress", {"x": 1}),
    ("optimizer", None), ("model", [])])
def test_a_hand_edited_checkpoint_is_refused_naming_the_key(key, value):
    with pytest.raises(UserError) as caught:
        check_resumable({**saved_state(), key: value}, "/ck/last.pt")
    assert_names(str(caught.value), "/ck/last.pt", repr(key))


def test_a_checkpoint_missing_what_a_resume_reads_is_refused_naming_the_key():
    snapshot = saved_state()
    del snapshot["rng"]
    with pytest.raises(UserError, match="'rng' is missing"):
        check_resumable(snapshot, "/ck/last.pt")


def mid_epoch(folder, samples: int, max_steps=None) -> dict:
    """A checkpoint of a run on 100 images in global batches of 16 (6 steps an epoch, 96 samples), `samples` into
    an epoch, as every rank has it at the check: its file mapped (rank 0 reads it whole)."""
    snapshot = saved_state()
    snapshot["epoch_progress"]["samples"] = samples
    snapshot["config"]["max_steps_per_epoch"] = max_steps
    snapshot["data"] = {"train": {"count": 100, "block": 100, "blocks": bytes(8)}}
    torch.save(snapshot, folder / "last.pt")
    return load(str(folder / "last.pt"), lazy=True)


@pytest.mark.parametrize(("samples", "max_steps"), [(97, None), (10 ** 6, None), (33, 2)])
def test_progress_past_the_end_of_the_checkpoints_epoch_is_refused_as_damaged_naming_the_key(tmp_path, samples,
                                                                                              max_steps):
    with pytest.raises(UserError, match="damaged") as caught:
        check_resumable(mid_epoch(tmp_path, samples, max_steps), "/ck/last.pt")
    assert_names(str(caught.value), "/ck/last.pt", "'epoch_progress'", samples)


@pytest.mark.parametrize(("samples", "max_steps"), [(0, None), (48, None), (96, None), (32, 2)])
def test_progress_within_the_checkpoints_epoch_resumes_whatever_this_runs_epoch_is(tmp_path, samples, max_steps):
    """Up to its end, which a checkpoint after an epoch's last step and before its validation is at; a resume at a
    larger global batch or smaller --max-steps-per-epoch may find it past its own epoch's end: that epoch ends."""
    check_resumable(mid_epoch(tmp_path, samples, max_steps), "/ck/last.pt")


@pytest.mark.parametrize("progress", [{"samples": -16}, {"samples": "16"}, {"steps": -1}])
def test_progress_that_is_not_a_count_is_refused_naming_the_key(progress):
    with pytest.raises(UserError) as caught:
        check_resumable({**saved_state(), "epoch_progress": progress}, "/ck/last.pt")
    assert_names(str(caught.value), "/ck/last.pt", "'epoch_progress'")


def test_an_epoch_progress_of_none_which_check_resumable_lets_pass_resumes_at_the_epoch_start():
    snapshot = {**saved_state(), "epoch_progress": None}
    check_resumable(snapshot, "/ck/last.pt")
    state = make_state(seed=1)
    apply_checkpoint(state, snapshot, "/ck/last.pt")
    assert state.tally == EpochTally() and state.step == snapshot["step"]


@pytest.mark.parametrize("edit", [
    lambda s: {**s, "model": {}},  # weights of another shape or none
    lambda s: {**s, "optimizer": {"state": {}, "param_groups": []}},
])
def test_weights_or_optimizer_state_that_do_not_fit_the_model_are_one_line_naming_the_file(edit):
    with pytest.raises(UserError) as caught:
        apply_checkpoint(make_state(seed=1), edit(saved_state()), "/ck/last.pt")
    assert "/ck/last.pt" in str(caught.value)


def test_the_weight_average_takes_the_weights_every_model_ema_steps_and_counts_its_updates():
    """--model-ema-steps 3, decay 0.5: the first update (step 3) copies the weights (timm's first update), the
    second (step 6) averages them; the steps between leave the average alone."""
    model = torch.nn.Linear(2, 1)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False),
                       ema=create_ema(model, decay=0.5, warmup=False))
    start = float(state.ema.module.weight[0, 0].detach())  # the average starts as a copy of the model
    seen = []
    for step in range(1, 8):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float(step))
        state.step = step
        state.update_average(every=3)
        seen.append(float(state.ema.module.weight[0, 0].detach()))
    assert seen == [start, start, 3.0, 3.0, 3.0, 4.5, 4.5]


# ----------------------------------------------------------------------------- PendingSteps

def test_pending_steps_fold_their_mean_loss_and_send_nothing_when_none_is_pending(monkeypatch):
    sent = []
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda t: sent.append(t.clone()) or t * 2)  # 2 equal ranks
    pending, tally = PendingSteps(torch.device("cpu")), EpochTally()
    for loss in (1.0, 3.0):
        pending.add(torch.tensor(loss, dtype=torch.float64))
    added = pending.fold_into(tally, global_batch=16, world_size=2)
    assert (added.samples, added.steps, added.loss_sum) == (32, 2, 4.0) and len(sent) == 1
    assert (tally.samples, tally.steps, tally.loss_sum) == (32, 2, 4.0)
    again = pending.fold_into(tally, global_batch=16, world_size=2)  # the epoch's end right after a log step
    assert (again.samples, again.steps, again.loss_sum) == (0, 0, 0.0) and len(sent) == 1
    assert (tally.samples, tally.steps) == (32, 2)

"""A diverged run (trainer.py's stop_if_diverged): weights gone NaN stop the run at the next loss it reads, before any
checkpoint holds them; a non-finite loss over finite weights (fp16's skipped step) trains on."""

from __future__ import annotations

import math

import inprocess
import pytest
import torch
from conftest import SMALL_RUN, assert_names, load_checkpoint

from imagenet_elastic.errors import UserError
from imagenet_elastic.train.trainer import Trainer


def args(image_folder, folder, *extra: str) -> list[str]:
    return [str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1", "--max-steps-per-epoch", "6",
            "--checkpoints-path", str(folder), *extra]


def weights_nan_after_step(step: int):
    """A before_fit hook: one weight becomes NaN at the end of `step`, as a too-high LR's update would make it."""
    def hook(trainer: Trainer) -> None:
        at_step_end = trainer.checkpointer.at_step_end

        def poisoned(at: int, stop_requested: bool) -> tuple[bool, bool]:
            if at == step:
                weight = next(trainer.state.model.parameters())
                with torch.no_grad():
                    weight[(0,) * weight.dim()] = math.nan
            return at_step_end(at, stop_requested)
        trainer.checkpointer.at_step_end = poisoned  # type: ignore[method-assign]
    return hook


def test_weights_gone_nan_stop_the_run_before_a_checkpoint_holds_them(image_folder, tmp_path):
    with pytest.raises(UserError) as stopped:
        inprocess.train(args(image_folder, tmp_path, "--checkpoint-interval", "2"),
                        before_fit=weights_nan_after_step(3))
    # the step whose loss showed it, the checkpoint kept and its step, the remedies
    assert_names(str(stopped.value), "step 4", "nan", tmp_path / "last.pt", "step 2", "--resume", "--lr",
                 "--clip-grad-norm")
    kept = load_checkpoint(tmp_path / "last.pt")
    assert kept["step"] == 2  # step 4's checkpoint was not written
    assert all(torch.isfinite(value).all() for value in kept["model"].values() if value.is_floating_point())


def test_a_run_diverged_before_its_first_checkpoint_writes_none(image_folder, tmp_path):
    with pytest.raises(UserError) as stopped:
        inprocess.train(args(image_folder, tmp_path), before_fit=weights_nan_after_step(1))
    assert_names(str(stopped.value), "step 2", "none was written", "--lr")
    assert not (tmp_path / "last.pt").exists()


def test_a_non_finite_loss_over_finite_weights_trains_on(image_folder, tmp_path):
    seen: list[bool] = []

    def hook(trainer: Trainer) -> None:
        trainer.stop_if_diverged(math.inf)  # what fp16's overflowed step reports: its update was skipped
        seen.append(True)
    outcome = inprocess.train(args(image_folder, tmp_path), before_fit=hook)
    assert seen and outcome.final_step == 6

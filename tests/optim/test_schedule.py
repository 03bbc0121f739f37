"""Learning rate: linear scaling, linear warmup, cosine decay."""

from __future__ import annotations

import math

import pytest
from inprocess import command

from imagenet_elastic.errors import UserError
from imagenet_elastic.optim.schedule import REFERENCE_BATCH, LRSchedule, scaled_lr

PEAK = 0.4
WARMUP = 10
TOTAL = 100


def test_scaled_lr_is_linear_in_the_global_batch():
    assert REFERENCE_BATCH == 256
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 1024) == pytest.approx(0.4)
    assert scaled_lr(0.1, 32) == pytest.approx(0.0125)
    assert scaled_lr(0.2, 512) == pytest.approx(2 * scaled_lr(0.1, 512))


def test_warmup_rises_linearly_to_the_peak():
    lrs = [LRSchedule(PEAK, WARMUP, TOTAL).at(step) for step in range(WARMUP)]
    assert lrs[0] == pytest.approx(PEAK / WARMUP)
    assert lrs[-1] == pytest.approx(PEAK)
    increments = [b - a for a, b in zip(lrs, lrs[1:])]
    assert all(d == pytest.approx(PEAK / WARMUP) for d in increments)


def test_first_step_after_warmup_is_the_peak():
    assert LRSchedule(PEAK, WARMUP, TOTAL).at(WARMUP) == pytest.approx(PEAK)


def test_cosine_reaches_about_zero_at_the_last_step():
    last = LRSchedule(PEAK, WARMUP, TOTAL).at(TOTAL - 1)
    assert 0.0 <= last < PEAK * 1e-3
    assert LRSchedule(PEAK, WARMUP, TOTAL).at(TOTAL) == pytest.approx(0.0, abs=1e-12)


def test_cosine_midpoint_is_half_the_peak():
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert LRSchedule(PEAK, WARMUP, TOTAL).at(middle) == pytest.approx(PEAK / 2)


def test_lr_is_monotone_non_increasing_after_warmup():
    lrs = [LRSchedule(PEAK, WARMUP, TOTAL).at(step) for step in range(WARMUP, TOTAL + 5)]
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))
    assert all(lr >= 0.0 for lr in lrs)
    assert lrs[0] > lrs[-1]


def test_zero_warmup_starts_at_the_peak_and_decays():
    assert LRSchedule(PEAK, 0, TOTAL).at(0) == pytest.approx(PEAK)
    lrs = [LRSchedule(PEAK, 0, TOTAL).at(step) for step in range(TOTAL)]
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))
    assert lrs[-1] < PEAK * 1e-3
    assert all(math.isfinite(lr) for lr in lrs)


def test_warmup_as_long_as_training_does_not_divide_by_zero():
    assert LRSchedule(PEAK, TOTAL, TOTAL).at(TOTAL - 1) == pytest.approx(PEAK)
    assert math.isfinite(LRSchedule(PEAK, TOTAL, TOTAL).at(TOTAL))


def test_cosine_to_zero_is_bitwise_the_formula_older_checkpoints_trained_with():
    schedule = LRSchedule(PEAK, WARMUP, TOTAL)
    for step in range(WARMUP, TOTAL + 1):
        progress = min(1.0, (step - WARMUP) / (TOTAL - WARMUP))
        assert schedule.at(step) == 0.5 * PEAK * (1.0 + math.cos(math.pi * progress))


def test_cosine_ends_at_lr_min():
    schedule = LRSchedule(PEAK, WARMUP, TOTAL, minimum=0.01)
    assert schedule.at(TOTAL) == pytest.approx(0.01)
    assert all(schedule.at(step) >= 0.01 for step in range(TOTAL + 5))
    assert schedule.at(WARMUP) == pytest.approx(PEAK)


def test_step_decay_multiplies_by_the_rate_every_interval_down_to_lr_min():
    schedule = LRSchedule(1.0, 0, 100, minimum=0.0005, kind="step", decay_every=30, decay_rate=0.1)
    assert [schedule.at(step) for step in (0, 29, 30, 59, 60, 90)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.001])
    assert schedule.at(120) == 0.0005


def test_step_decay_warms_up_first():
    schedule = LRSchedule(1.0, 4, 100, kind="step", decay_every=30)
    assert [schedule.at(step) for step in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_linear_decay_falls_in_a_straight_line_from_the_peak_to_the_minimum():
    """FFCV's triangle: up over the warmup, down in a straight line to --lr-min at the end."""
    schedule = LRSchedule(PEAK, WARMUP, TOTAL, minimum=0.01, kind="linear")
    assert schedule.at(WARMUP) == pytest.approx(PEAK)
    assert schedule.at(WARMUP + (TOTAL - WARMUP) // 2) == pytest.approx((PEAK + 0.01) / 2)
    assert schedule.at(TOTAL) == pytest.approx(0.01)
    steps = [schedule.at(step) for step in range(WARMUP, TOTAL + 1)]
    assert all(b - a == pytest.approx((0.01 - PEAK) / (TOTAL - WARMUP)) for a, b in zip(steps, steps[1:]))
    assert schedule.describe() == "warmup 10 steps, linear over 100, down to 0.01"


def test_a_minimum_above_the_peak_is_refused_and_one_at_it_is_a_constant_lr():
    with pytest.raises(UserError, match="--lr-min 0.5 is above the peak LR 0.4"):
        LRSchedule(PEAK, WARMUP, TOTAL, minimum=0.5)
    assert LRSchedule(PEAK, WARMUP, TOTAL, minimum=PEAK).at(TOTAL // 2) == pytest.approx(PEAK)


def test_an_lr_min_above_the_scaled_lr_exits_2_naming_both(image_folder, tmp_path):
    """--lr 0.1 at a global batch of 8 peaks at 0.003125: an --lr-min of 0.05, below --lr, is still above it."""
    finished = command([str(image_folder), "--model", "test_resnet", "--batch-size", "8", "--workers", "0",
                        "--epochs", "1", "--max-steps-per-epoch", "1", "--amp", "none", "--lr", "0.1",
                        "--lr-min", "0.05", "--checkpoints-path", str(tmp_path / "run")])
    assert finished.returncode == 2 and len(finished.stderr.strip().splitlines()) == 1, finished.stderr
    assert "--lr-min 0.05" in finished.stderr and "--lr " in finished.stderr and "0.003125" in finished.stderr
    assert not list((tmp_path / "run").glob("*.pt"))

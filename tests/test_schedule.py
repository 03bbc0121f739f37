"""Learning rate: linear scaling, linear warmup, cosine decay."""

from __future__ import annotations

import math

import pytest

from imagenet_elastic.schedule import REFERENCE_BATCH, lr_at, scaled_lr

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
    lrs = [lr_at(step, PEAK, WARMUP, TOTAL) for step in range(WARMUP)]
    assert lrs[0] == pytest.approx(PEAK / WARMUP)
    assert lrs[-1] == pytest.approx(PEAK)
    increments = [b - a for a, b in zip(lrs, lrs[1:])]
    assert all(d == pytest.approx(PEAK / WARMUP) for d in increments)


def test_first_step_after_warmup_is_the_peak():
    assert lr_at(WARMUP, PEAK, WARMUP, TOTAL) == pytest.approx(PEAK)


def test_cosine_reaches_about_zero_at_the_last_step():
    last = lr_at(TOTAL - 1, PEAK, WARMUP, TOTAL)
    assert 0.0 <= last < PEAK * 1e-3
    assert lr_at(TOTAL, PEAK, WARMUP, TOTAL) == pytest.approx(0.0, abs=1e-12)


def test_cosine_midpoint_is_half_the_peak():
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert lr_at(middle, PEAK, WARMUP, TOTAL) == pytest.approx(PEAK / 2)


def test_lr_is_monotone_non_increasing_after_warmup():
    lrs = [lr_at(step, PEAK, WARMUP, TOTAL) for step in range(WARMUP, TOTAL + 5)]
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))
    assert all(lr >= 0.0 for lr in lrs)
    assert lrs[0] > lrs[-1]


def test_zero_warmup_starts_at_the_peak_and_decays():
    assert lr_at(0, PEAK, 0, TOTAL) == pytest.approx(PEAK)
    lrs = [lr_at(step, PEAK, 0, TOTAL) for step in range(TOTAL)]
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))
    assert lrs[-1] < PEAK * 1e-3
    assert all(math.isfinite(lr) for lr in lrs)


def test_warmup_as_long_as_training_does_not_divide_by_zero():
    assert lr_at(TOTAL - 1, PEAK, TOTAL, TOTAL) == pytest.approx(PEAK)
    assert math.isfinite(lr_at(TOTAL, PEAK, TOTAL, TOTAL))

"""How far ahead a rank's loader workers prepare batches: 4 each, fewer where the batches they hold would pin more
than a GiB of the node's memory (pipeline.prefetch_factor), and what the start-up table says of it."""

from __future__ import annotations

import contextlib

import pytest
from inprocess import in_memory

from imagenet_elastic import cli
from imagenet_elastic.data import pipeline
from imagenet_elastic.data.decoding import Feed
from imagenet_elastic.data.resolution import TrainSizes
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.launch.preemption import PreemptionFlag
from imagenet_elastic.report.console import Console
from imagenet_elastic.train import build
from imagenet_elastic.train.startup_table import describe_loader_workers

RESNET50_BATCH = 256 * 224 * 224 * 3  # 38.5 MB of uint8 pixels


def test_a_batch_weighs_its_pixels_or_under_decode_gpu_imagenets_mean_files():
    assert pipeline.batch_bytes(256, 224, encoded=False) == RESNET50_BATCH
    assert pipeline.batch_bytes(256, 224, encoded=True) == 256 * 110_000  # whatever the crop size


@pytest.mark.parametrize(("workers", "ahead"), [(2, 4), (4, 4), (6, 4), (8, 3), (10, 2), (14, 2), (64, 2)])
def test_pinned_batches_ahead_are_lowered_to_fit_a_gib_but_never_below_two(workers, ahead):
    """resnet50 at batch 256 and 224 px: 14 workers 4 ahead would pin 2.2 GB a rank, 17 GB on a node of 8."""
    assert pipeline.prefetch_factor(workers, RESNET50_BATCH, pinned=True) == ahead
    assert ahead == 2 or workers * ahead * RESNET50_BATCH <= 2**30  # within the budget, but for the floor
    assert ahead == 4 or workers * (ahead + 1) * RESNET50_BATCH > 2**30  # and as many as fit


def test_batches_that_are_not_pinned_or_have_no_workers_keep_four_ahead():
    assert pipeline.prefetch_factor(14, RESNET50_BATCH, pinned=False) == 4  # CPU: nothing pinned
    assert pipeline.prefetch_factor(0, RESNET50_BATCH, pinned=True) == 4  # no workers: DataLoader takes no factor
    assert pipeline.prefetch_factor(14, 256 * 110_000, pinned=True, budget=2**32) == 4


def test_the_largest_training_size_is_the_ramps_end():
    assert TrainSizes(224).largest == 224
    assert TrainSizes(224, (160, 192), (10, 13)).largest == 192  # --image-size is validation's there


def test_the_start_up_table_says_how_far_ahead_the_workers_prepare_and_the_budget_where_they_pin():
    row = describe_loader_workers
    assert row(8, Feed(None, 14, 2, True, None)) == "8 / 14 per process, 2 batches ahead each (pinned budget 1 GiB)"
    assert row(2, Feed(None, 1, 4, False, None)) == "2 / 1 per process, 4 batches ahead each"
    assert row(2, Feed(None, 0, 4, False, None)) == "2 / 0 per process"


@pytest.mark.parametrize(("decode", "batch"), [("cpu", 8 * 96 * 96 * 3), ("gpu", 8 * 110_000)])
def test_the_build_step_gives_both_loaders_the_factor_of_its_largest_batch(monkeypatch, tmp_path, decode, batch):
    """Progressive resizing ends at 96 px here, validation crops 64: the factor is the 96 px batch's. Faked: the
    pinning (a CPU pins nothing), so the factor is what prefetch_factor answers."""
    asked = []

    def prefetch_factor(workers: int, batch_bytes: int, pinned: bool) -> int:
        asked.append((workers, batch_bytes, pinned))
        return 3

    monkeypatch.setattr(pipeline, "prefetch_factor", prefetch_factor)
    config, _ = cli.parse([str(tmp_path), "--model", "test_resnet", "--batch-size", "8", "--workers", "1",
                           "--image-size", "64", "--progressive-resize", "32,96", "--progressive-epochs", "0,2",
                           "--decode", decode, "--checkpoints-path", str(tmp_path / "ckpt")])
    run = build.Run(config, DistEnv(), Console(False), PreemptionFlag(()))
    with contextlib.ExitStack() as stack:
        inputs, snapshot = build.check_inputs(run, stack, in_memory(2, 4, 2))
        training = build.prepare_training(run, inputs, snapshot)
        loaders = build.build_loaders(run, inputs, training, stack)
        assert asked == [(1, batch, False)]
        assert (loaders.feed.prefetch, loaders.train.prefetch_factor, loaders.val.prefetch_factor) == (3, 3, 3)

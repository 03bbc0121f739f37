"""--progressive-resize / --progressive-epochs: the train size of an epoch, FFCV's rule, from the epoch alone."""

from __future__ import annotations

import pytest
from makers import make_split

from imagenet_elastic import cli
from imagenet_elastic.config import Config
from imagenet_elastic.data.pipeline import TrainDataset
from imagenet_elastic.data.resolution import TrainSizes
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import UserError


def test_ffcv_resnet50_16_and_88_epoch_ramps_give_ffcvs_sizes():
    """160 -> 192 over epochs 11-13 (16 epochs) and 65-76 (88 epochs); FFCV's numpy rounding, half to even."""
    short = TrainSizes(224, (160, 192), (11, 13))
    assert [short(e) for e in range(16)] == [160] * 12 + [192] * 4
    long = TrainSizes(224, (160, 192), (65, 76))
    assert [long(e) for e in range(88)] == [160] * 71 + [192] * 17


def test_a_wide_ramp_steps_through_multiples_of_32_and_stays_at_its_ends():
    sizes = TrainSizes(224, (128, 256), (2, 6))
    assert [sizes(e) for e in range(9)] == [128, 128, 128, 160, 192, 224, 256, 256, 256]
    assert TrainSizes(224)(0) == TrainSizes(224)(99) == 224  # no ramp: --image-size every epoch
    odd = TrainSizes(224, (176, 240), (1, 3))  # ends not multiples of 32: kept exactly, as FFCV keeps them
    assert [odd(e) for e in range(5)] == [176, 176, 192, 240, 240]  # 208 / 32 = 6.5 rounds half to even
    assert sizes.describe(9) == "128 -> 256 px over epochs 3-7 (128, 160, 192, 224, 256)"
    assert TrainSizes(224).describe(9) == "224 px"


@pytest.mark.parametrize(("ramp", "epochs", "expected"), [
    ((10, 20), (0, 2), [10, 20, 20]),  # 15 rounds to 0, and 32 would be above HIGH
    ((170, 200), (0, 10), [170, 170, 192, 192, 192, 192, 192, 192, 192, 192, 200]),  # 173 rounds to 160 < LOW
    ((8, 35), (1, 5), [8, 8, 32, 32, 32, 35]),  # in range already: as before
])
def test_ramp_sizes_stay_within_low_and_high_and_never_shrink(ramp, epochs, expected):
    sizes = [TrainSizes(224, ramp, epochs)(e) for e in range(len(expected))]
    assert sizes == expected and sizes == sorted(sizes)


def test_each_epochs_samples_come_at_that_epochs_size(tmp_path):
    make_split(tmp_path / "train", {"a": 2, "b": 2}, size=(64, 48))
    dataset = TrainDataset(scan_image_folder(str(tmp_path / "train"), "train"), TrainSizes(24, (32, 64), (0, 1)), 0)
    assert dataset[(0, 1)][0].shape == (32, 32, 3)
    assert dataset[(1, 1)][0].shape == (64, 64, 3)
    assert dataset[(5, 3)][0].shape == (64, 64, 3)


def test_the_config_carries_the_ramp_to_the_loader():
    config, _ = cli.parse(["/data", "--progressive-resize", "160,192", "--progressive-epochs", "11,13"])
    assert config.train_sizes == TrainSizes(224, (160, 192), (11, 13))


@pytest.mark.parametrize(("flags", "message"), [
    (["--progressive-resize", "192,160"], "argument --progressive-resize: must be increasing"),
    (["--progressive-epochs", "5,5"], "argument --progressive-epochs: must be increasing"),
    (["--progressive-resize", "0,32"], "argument --progressive-resize: must be increasing (1 <= LOW"),
    (["--progressive-resize", "160"], "argument --progressive-resize: expected two integers"),
])
def test_a_range_that_is_not_increasing_exits_2_naming_the_flag(capsys, flags, message):
    with pytest.raises(SystemExit) as caught:
        cli.parse(["/data", *flags])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(("changes", "message"), [
    ({"progressive_resize": (160, 192)}, "--progressive-resize needs --progressive-epochs too"),
    ({"progressive_epochs": (1, 3)}, "--progressive-epochs needs --progressive-resize too"),
    ({"bce_target_thresh": 0.2}, "--bce-target-thresh applies to --bce-loss only"),
])
def test_options_missing_their_partner_are_refused(changes, message):
    with pytest.raises(UserError, match=message.replace("-", r"\-")):
        Config(data="/data", **changes)

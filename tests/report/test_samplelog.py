"""The sample log's verdict: it must catch a lost, a repeated and a redone step, not only pass clean runs."""

from __future__ import annotations

import pytest
from conftest import SMALL_RUN, assert_names, single_line
from inprocess import command

from imagenet_elastic.data.sampler import BatchPlan, TrainBatchSampler
from imagenet_elastic.errors import UserError
from imagenet_elastic.report.samplelog import ENV_VAR, SampleLog, check_folder, coverage

SAMPLES, GLOBAL = 24, 4


def log_epoch(folder, epoch, steps, world_size=2, start_sample=0, first_step=0):
    """What the trainer records: each rank its share of each step, from `start_sample` on."""
    plan = BatchPlan(GLOBAL, world_size, GLOBAL)
    for rank in range(world_size):
        sampler = TrainBatchSampler(SAMPLES, plan, rank, seed=0)
        sampler.set_epoch(epoch, start_sample)
        log = SampleLog(str(folder), rank, world_size)
        for k, keys in zip(range(steps), sampler):
            log.record(epoch, first_step + k, [i for _, i in keys])
        log.close()


def test_clean_run_covers_every_sample_once(tmp_path):
    for epoch in range(2):
        log_epoch(tmp_path, epoch, 6, first_step=6 * epoch)
    report = coverage(str(tmp_path), SAMPLES, GLOBAL)
    assert (report.epochs, report.steps, report.samples_trained) == (2, 12, 48)
    assert (report.samples_lost, report.samples_repeated, report.steps_redone) == (0, 0, 0)


def test_rollback_then_world_size_change_is_redone_not_repeated(tmp_path):
    log_epoch(tmp_path, 0, 4)  # steps 0-3 at world size 2, then a crash; the checkpoint was after step 2
    log_epoch(tmp_path, 0, 3, world_size=1, start_sample=3 * GLOBAL, first_step=3)  # 3-5 again at world 1
    report = coverage(str(tmp_path), SAMPLES, GLOBAL)
    assert (report.samples_lost, report.samples_repeated, report.steps_redone) == (0, 0, 1)
    assert report.world_sizes == (2, 1)
    log_epoch(tmp_path, 1, 6, first_step=6)
    assert coverage(str(tmp_path), SAMPLES, GLOBAL).world_sizes == (2, 1, 2)  # changes, not distinct sizes


def test_skipped_step_is_reported_as_lost(tmp_path):
    log_epoch(tmp_path, 0, 2)
    log_epoch(tmp_path, 0, 3, start_sample=3 * GLOBAL, first_step=2)  # resumed one step too far
    assert coverage(str(tmp_path), SAMPLES, GLOBAL).samples_lost == GLOBAL


def test_step_trained_twice_under_two_numbers_is_reported_as_repeated(tmp_path):
    log_epoch(tmp_path, 0, 3)
    log_epoch(tmp_path, 0, 4, start_sample=2 * GLOBAL, first_step=3)  # resumed one step too early
    assert coverage(str(tmp_path), SAMPLES, GLOBAL).samples_repeated == GLOBAL


def test_attempts_of_one_step_that_disagree_are_an_error(tmp_path):
    log_epoch(tmp_path, 0, 1)
    log_epoch(tmp_path, 1, 1)  # epoch 1's first batch logged as epoch 0's step 0
    for path in tmp_path.iterdir():
        path.write_text(path.read_text().replace('"epoch": 1', '"epoch": 0'))
    with pytest.raises(AssertionError, match="distinct samples"):
        coverage(str(tmp_path), SAMPLES, GLOBAL)


def test_a_file_where_the_log_folder_goes_is_refused_naming_the_variable_and_left_as_it_was(tmp_path):
    earlier = tmp_path / "samples.jsonl"
    earlier.write_text('{"epoch": 0}\n')
    for folder in (earlier, earlier / "sub"):
        with pytest.raises(UserError) as raised:
            SampleLog(str(folder), 0, 1)
        assert ENV_VAR in str(raised.value) and str(folder) in str(raised.value)
    assert earlier.read_text() == '{"epoch": 0}\n'


def test_a_folder_of_earlier_logs_takes_a_new_file_beside_them(tmp_path):
    log_epoch(tmp_path / "log", 0, 1, world_size=1)
    log_epoch(tmp_path / "log", 0, 1, world_size=1)
    assert len(list((tmp_path / "log").iterdir())) == 2


def test_a_bad_log_folder_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    """Checked with the run's inputs: the variable's line comes, not DATA's (a folder that does not exist)."""
    earlier = tmp_path / "samples.jsonl"
    earlier.write_text("mine")
    monkeypatch.setenv(ENV_VAR, str(earlier / "log"))
    finished = command([str(tmp_path / "no-data"), *SMALL_RUN, "--checkpoints-path", str(tmp_path / "ckpt")])
    assert finished.returncode == 2
    assert_names(single_line(finished.stderr), f"{ENV_VAR}={earlier / 'log'}", earlier)
    assert earlier.read_text() == "mine" and not (tmp_path / "ckpt").exists()


def test_checking_a_new_log_folder_makes_nothing(tmp_path):
    check_folder(str(tmp_path / "a" / "b"))
    check_folder(None)
    assert list(tmp_path.iterdir()) == []

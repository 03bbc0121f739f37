"""Reporting as sinks (report/sinks, rows built in report/metrics.py): a metric added where a row is built reaches
steps.jsonl or metrics.jsonl, TensorBoard's event file, W&B's offline run and a real MLflow store, read back with each
one's own reader; one number rule for every sink; a sink that fails is left out with one warning while the others go
on; a tracker brings its own flag's help. Resumes, kills and failing trackers: test_step_log.py, test_trackers.py."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import inprocess
import pytest
from conftest import SMALL_RUN, assert_names, single_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imagenet_elastic.config import Config
from imagenet_elastic.report import metrics
from imagenet_elastic.report.sinks import TRACKERS, Sink, Sinks, steps_file, wandb_tracker
from imagenet_elastic.report.sinks.tensorboard_events import FOLDER as TENSORBOARD
from imagenet_elastic.report.sinks.tensorboard_events import TensorBoard
from imagenet_elastic.tools import plot


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network: W&B offline under the test's folder (its service's address from an earlier test dropped)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store: a real store, quicker to make than sqlite
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    (tmp_path / "wandb_dir").mkdir()


def with_probes(monkeypatch) -> None:
    """One line each where the rows are built: `probe` in every step row, `epoch_probe` in every epoch row."""
    step_row, epoch_row = metrics.step_row, metrics.epoch_row
    monkeypatch.setattr(metrics, "step_row", lambda *a, **k: {**step_row(*a, **k), "probe": a[0] / 4})
    monkeypatch.setattr(metrics, "epoch_row", lambda **k: {**epoch_row(**k), "epoch_probe": k["epoch"] + 0.5})


def test_a_metric_added_where_the_rows_are_built_reaches_every_sink(tmp_path, monkeypatch, offline):
    with_probes(monkeypatch)
    ckpt, store = tmp_path / "ckpt", f"file:{tmp_path}/mlruns"
    inprocess.train(["memory", *SMALL_RUN, "--workers", "0", "--threads", "1", "--epochs", "2",
                     "--max-steps-per-epoch", "4", "--log-interval", "2", "--checkpoints-path", str(ckpt),
                     "--tensorboard", "--wandb", "tests", "--mlflow", store], splits=inprocess.in_memory())
    steps, epochs = {2: 0.5, 4: 1.0, 6: 1.5, 8: 2.0}, {4: 1.5, 8: 2.5}

    rows = [json.loads(line) for line in (ckpt / steps_file.FILENAME).read_text().splitlines()]
    assert {row["step"]: row["probe"] for row in rows} == steps
    assert {row["step"]: row["epoch_probe"] for row in metrics.read(str(ckpt / metrics.FILENAME))} == epochs

    events = EventAccumulator(str(ckpt / TENSORBOARD))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/probe")} == steps
    assert {e.step: e.value for e in events.Scalars("epoch/epoch_probe")} == epochs

    (log,) = glob.glob(os.path.join(tmp_path, "wandb_dir", "wandb", "offline-run-*", "run-*.wandb"))
    history = list(wandb_tracker.wandb_history(log))
    assert {step: values["train/probe"] for step, values in history if "train/probe" in values} == steps
    assert {step: values["epoch/epoch_probe"] for step, values in history if "epoch/epoch_probe" in values} == epochs

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("imagenet_elastic").experiment_id])
    for key, expected in (("train/probe", steps), ("epoch/epoch_probe", epochs)):
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} == expected


def test_one_number_rule_bools_count_strings_and_nulls_do_not():
    """Every sink's scalars, steps.jsonl's trimming and the plot read a row's values by one rule: JSON's numbers and
    true/false (an epoch's `resumed` mark is a point at 1 everywhere); never a string or null."""
    row = {"step": 12, "epoch": 2, "val_top1": 50.0, "resumed": True, "skipped": False, "model": "x", "lr": None}
    assert metrics.scalars(metrics.EPOCH, row) == {"epoch/epoch": 2.0, "epoch/val_top1": 50.0, "epoch/resumed": 1.0,
                                                   "epoch/skipped": 0.0}
    assert steps_file.is_number is plot.is_number is metrics.is_number


class Recorder(Sink):
    def __init__(self, name: str, fails: bool = False) -> None:
        self.name, self.fails, self.rows, self.closed = name, fails, [], []

    def step(self, row: dict[str, Any]) -> None:
        if self.fails:
            raise OSError(28, "No space left on device")
        self.rows.append(row)

    def epoch(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def close(self, finished: bool) -> None:
        self.closed.append(finished)


def test_a_sink_that_fails_is_left_out_with_one_warning_and_the_others_go_on(tmp_path):
    warned: list[str] = []
    full, kept = Recorder("full", fails=True), Recorder("kept")
    sinks = Sinks([full, kept], str(tmp_path), warned.append)
    sinks.start(0, [], {}, continuing=False, started_from=None, name="run", settings={}, facts={})
    for step in (1, 2):
        sinks.step({"step": step, "loss": 1.0})
    sinks.epoch({"step": 2, "val_top1": 3.0})
    sinks.close(finished=True)
    assert len(warned) == 1, warned  # one warning: the sink left out, and its error
    assert_names(single_line(warned[0]), "full", "[Errno 28] No space left on device")
    assert [row["step"] for row in kept.rows] == [1, 2, 2] and full.rows == []
    assert full.closed == [False] and kept.closed == [True]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # pytest's threading.excepthook
def test_tensorboard_writer_that_cannot_write_is_one_warning_without_its_threads_traceback(tmp_path):
    """The writer opens its event file in a thread of its own at each write: a folder it cannot write to (here
    replaced by a file, which stops root too) fails there, and only the sink's warning says so."""
    warned: list[str] = []
    sinks = Sinks([TensorBoard(str(tmp_path))], str(tmp_path), warned.append)
    sinks.start(0, [], {}, continuing=False, started_from=None, name="run", settings={}, facts={})
    sinks.step({"step": 1, "loss": 1.0})
    folder = tmp_path / TENSORBOARD
    os.rename(folder, tmp_path / "moved")
    folder.write_text("")
    sinks.step({"step": 2, "loss": 1.0})
    sinks.close(finished=False)  # joins the writer's thread, then raises the error it kept
    assert len(warned) == 1, warned
    assert_names(single_line(warned[0]), str(folder))


def test_each_tracker_brings_its_own_setting_flag_and_help():
    """A new tracker is its module and a line in TRACKERS: Config's field for it takes the help and metavar from
    the tracker's class."""
    fields = {f.name: f.metadata for f in dataclasses.fields(Config)}
    for option, tracker in TRACKERS.items():
        assert fields[option]["help"] == tracker.help and fields[option]["metavar"] == tracker.metavar, option

"""Experiment trackers (report/sinks/tracker.py, a module per tracker): a run logged to MLflow (a local store, read
back with MLflow's own client) and to W&B (offline: its transaction logs, read as `wandb sync` reads them) is one
tracker run that holds every step once, in order, with steps.jsonl's values, whether it was stopped and resumed with
--resume, restarted before its first checkpoint, or SIGKILLed after its last; a tracker that fails mid-run costs one
warning; a store that cannot be written is one line at start-up."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
from pathlib import Path

import inprocess
import pytest
from conftest import SMALL_RUN, assert_names, python_cmd, run, run_and_kill

from imagenet_elastic.errors import UserError
from imagenet_elastic.report import sinks
from imagenet_elastic.report.sinks import tracker as trackers
from imagenet_elastic.report.sinks import wandb_tracker
from imagenet_elastic.report.sinks.steps_file import FILENAME as STEPS
from imagenet_elastic.report.sinks.tracker import TrackerRuns

EPOCHS, STEPS_PER_EPOCH = 2, 12  # 96 images, a global batch of 8


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, every store under the test's folder; the file store MLflow only keeps for old runs, allowed."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # wandb.init in this process (an earlier in-process test) leaves its service's address here for child processes
    # to share; a killed child's run would then stay open in it, and the same run id could not start again.
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    (tmp_path / "wandb_dir").mkdir()


def args(ckpt: Path, store: str, *more: str) -> list[str]:
    return ["memory", *SMALL_RUN, "--workers", "0", "--threads", "1", "--epochs", str(EPOCHS), "--no-tensorboard",
            "--checkpoints-path", str(ckpt), "--mlflow", store, "--wandb", "tests", *more]


def steps_jsonl(ckpt: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (ckpt / STEPS).read_text().splitlines()]
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    return {r["step"]: r for r in rows}


def mlflow_runs(store: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("imagenet_elastic")
    return client.search_runs([experiment.experiment_id])


def assert_mlflow_holds(store: str, ckpt: Path) -> None:
    """One run; every step of steps.jsonl once, in order, with its values; every epoch once at its last step."""
    from mlflow import MlflowClient

    runs = mlflow_runs(store)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    client, run_id = MlflowClient(tracking_uri=store), runs[0].info.run_id
    rows = steps_jsonl(ckpt)
    for key in ("loss", "lr", "images_per_sec", "epoch"):
        history = client.get_metric_history(run_id, f"train/{key}")
        assert [m.step for m in history] == list(rows), key
        if key in ("loss", "lr", "epoch"):  # trained again exactly; images/s is the clock's
            assert [m.value for m in history] == [rows[s][key] for s in rows], key
    epochs = client.get_metric_history(run_id, "epoch/val_top1")
    metrics = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [m.step for m in epochs] == [row["step"] for row in metrics] == [12, 24]
    assert [m.value for m in epochs] == [row["val_top1"] for row in metrics]
    assert runs[0].data.params["epochs"] == str(EPOCHS)
    assert runs[0].data.tags["startup.steps per epoch"] == str(STEPS_PER_EPOCH)


def wandb_history(run_id: str) -> list[tuple[int, dict]]:
    """Every history row of the run's transaction logs, in the order `wandb sync` uploads them (start time)."""
    logs = wandb_tracker.transaction_logs(os.path.join(os.environ["WANDB_DIR"], "wandb"), run_id)
    return [row for path in logs for row in wandb_tracker.wandb_history(path)]


def assert_wandb_holds(ckpt: Path) -> None:
    """(A start within the same second as the one before it has its folder named `offline-run-TIME-ID-1`.)"""
    ids = {Path(path).name.split("-")[3]
           for path in glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", "offline-run-*"))}
    assert len(ids) == 1, ids
    history = wandb_history(ids.pop())
    train = [(step, values) for step, values in history if trackers.TRAIN_KEY in values]
    rows = steps_jsonl(ckpt)
    assert [step for step, _ in train] == list(rows)
    for key in ("loss", "lr", "epoch"):
        assert [values[f"train/{key}"] for _, values in train] == [rows[s][key] for s in rows], key
    assert [step for step, values in history if "epoch/val_top1" in values] == [12, 24]
    steps = [step for step, _ in history]
    assert steps == sorted(steps)


def test_wandbs_logs_of_a_run_are_each_of_its_starts_oldest_first_those_in_the_same_second_too():
    """W&B names a start's folder by its second; a start in the same second as the one before gets `-1` after it
    (`-2`, ... `-10`): each is a start of the run, whose rows a restart must count (held)."""
    wandb_dir = Path(os.environ["WANDB_DIR"]) / "wandb"
    names = ["offline-run-20260102_030405-abcd1234-1", "run-20260102_030406-abcd1234",
             "offline-run-20260102_030405-abcd1234", "offline-run-20260102_030405-abcd1234-10",
             "offline-run-20260102_030405-abcd1234-2", "offline-run-20260101_000000-other123"]
    for name in names:
        (wandb_dir / name).mkdir(parents=True)
        (wandb_dir / name / f"run-{'other123' if 'other123' in name else 'abcd1234'}.wandb").touch()
    (wandb_dir / "offline-run-20260102_030407-abcd1234").mkdir()  # a start killed before its log was made
    assert wandb_tracker.transaction_logs(str(wandb_dir), "abcd1234") == [
        str(wandb_dir / name / "run-abcd1234.wandb") for name in (
            "offline-run-20260102_030405-abcd1234", "offline-run-20260102_030405-abcd1234-1",
            "offline-run-20260102_030405-abcd1234-2", "offline-run-20260102_030405-abcd1234-10",
            "run-20260102_030406-abcd1234")]


def test_a_run_stopped_and_resumed_is_one_run_in_each_tracker_with_every_step_once(tmp_path):
    store, ckpt = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "ckpt"
    first = inprocess.train(args(ckpt, store, "--checkpoint-interval", "5"), signal_during_step=16,
                            splits=inprocess.in_memory())
    assert first.stopped and first.final_step == 16
    second = inprocess.train(args(ckpt, store, "--resume"), splits=inprocess.in_memory())
    assert not second.stopped and second.final_step == EPOCHS * STEPS_PER_EPOCH
    assert_mlflow_holds(store, ckpt)
    assert_wandb_holds(ckpt)
    assert not (ckpt / trackers.PENDING).exists()


def killed_at(step: int):
    """A before_fit hook: the run dies at the end of `step` (an error, not a stop: no checkpoint of its own)."""
    def hook(trainer) -> None:
        at_step_end = trainer.checkpointer.at_step_end

        def dying(current: int, stop_requested: bool):
            if current == step:
                raise RuntimeError(f"killed after step {step}")
            return at_step_end(current, stop_requested)

        trainer.checkpointer.at_step_end = dying
    return hook


def killed_then_resumed(tmp_path, before_fit, dies_with: str, logged_to: int) -> None:
    """A run checkpointing every 5 steps dies in `before_fit`'s way, having logged steps up to `logged_to`; its
    resumed run leaves each tracker holding every step once, as steps.jsonl does (MLflow's file store here)."""
    store, ckpt = f"file:{tmp_path}/mlruns", tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match=dies_with):
        inprocess.train(args(ckpt, store, "--checkpoint-interval", "5"), before_fit=before_fit,
                        splits=inprocess.in_memory())
    assert max(steps_jsonl(ckpt)) == logged_to
    inprocess.train(args(ckpt, store, "--resume"), splits=inprocess.in_memory())
    assert_mlflow_holds(store, ckpt)
    assert_wandb_holds(ckpt)


def test_steps_a_killed_run_logged_past_its_checkpoint_are_not_sent_again(tmp_path):
    """Killed at step 18, its last checkpoint at step 15: the resumed run trains 16-18 again, and the trackers,
    which already hold them, do not get them twice (MLflow's file store here)."""
    killed_then_resumed(tmp_path, killed_at(18), "killed after step 18", logged_to=18)


def test_a_run_killed_while_validating_sends_the_epochs_row_at_a_step_the_trackers_already_hold(tmp_path):
    """Killed in epoch 1's validation: the trackers hold step 12's training row, not the epoch's row, which the
    resumed run sends (each kind of row counts its own last step)."""
    def dies_validating(trainer) -> None:
        def validate():
            raise RuntimeError("killed while validating")
        trainer.validate = validate

    killed_then_resumed(tmp_path, dies_validating, "killed while validating", logged_to=12)


def test_a_run_killed_before_its_first_checkpoint_restarts_into_the_same_tracker_runs(tmp_path):
    store, ckpt = f"file:{tmp_path}/mlruns", tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="killed after step 3"):
        inprocess.train(args(ckpt, store, "--resume"), before_fit=killed_at(3), splits=inprocess.in_memory())
    assert not (ckpt / "last.pt").exists()
    pending = json.loads((ckpt / trackers.PENDING).read_text())
    assert set(pending) == {"wandb", "mlflow"}
    inprocess.train(args(ckpt, store, "--resume"), splits=inprocess.in_memory())
    assert_mlflow_holds(store, ckpt)
    assert_wandb_holds(ckpt)
    assert not (ckpt / trackers.PENDING).exists()  # the checkpoints hold the runs now


def test_a_pending_tracker_run_is_continued_only_by_a_start_from_the_checkpoint_it_was_made_from(tmp_path):
    """trackers.json keeps a new run's id with the time stamp of the checkpoint its start resumed from (None: none)."""
    checkpoint, other = 1_700_000_000.25, 1_700_000_600.5
    first = TrackerRuns(str(tmp_path), print)
    first.begin({}, continuing=True, started_from=checkpoint)
    first.made("mlflow", "run-a")
    assert json.loads((tmp_path / trackers.PENDING).read_text()) == {"mlflow": {"id": "run-a", "from": checkpoint}}

    def continued(saved: dict, continuing: bool, started_from) -> object:
        runs = TrackerRuns(str(tmp_path), print)
        runs.begin(saved, continuing, started_from)
        return runs.earlier("mlflow")
    assert continued({}, True, checkpoint) == "run-a"
    assert continued({}, True, other) is None  # a start from a later checkpoint
    assert continued({}, True, None) is None  # a start from no checkpoint
    assert continued({}, False, checkpoint) is None  # a new run in the folder
    assert continued({"mlflow": "run-b"}, True, checkpoint) == "run-b"  # a checkpoint's run wins


def test_a_new_run_in_the_same_folder_is_a_new_tracker_run(tmp_path):
    store, ckpt = f"file:{tmp_path}/mlruns", tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="killed after step 3"):
        inprocess.train(args(ckpt, store), before_fit=killed_at(3), splits=inprocess.in_memory())
    inprocess.train(args(ckpt, store, "--epochs", "1"), splits=inprocess.in_memory())  # no --resume: starts over
    assert len(mlflow_runs(store)) == 2


def test_a_checkpoint_continued_in_a_new_folder_logs_to_a_tracker_run_of_its_own(tmp_path):
    """A fork (a new run_id) must not append its steps to its origin's tracker run."""
    store = f"file:{tmp_path}/mlruns"

    def mlflow_only(folder: str, *more: str) -> list[str]:
        return [a for a in args(tmp_path / folder, store, *more) if a not in ("--wandb", "tests")]

    inprocess.train(mlflow_only("origin", "--epochs", "1"), splits=inprocess.in_memory())
    inprocess.train(mlflow_only("fork", "--resume", str(tmp_path / "origin" / "last.pt")), splits=inprocess.in_memory())
    origin_run, fork_run = (torch_load(tmp_path / f / "last.pt")["trackers"]["mlflow"] for f in ("origin", "fork"))
    assert fork_run != origin_run and len(mlflow_runs(store)) == 2


def test_a_tracker_first_named_at_a_resume_gets_the_whole_run(tmp_path):
    """A checkpoint without tracker runs (from before this option, or without it): the new run is sent steps.jsonl
    and metrics.jsonl's earlier rows first."""
    store, ckpt = f"file:{tmp_path}/mlruns", tmp_path / "ckpt"
    plain = [a for a in args(ckpt, store) if a not in ("--mlflow", store, "--wandb", "tests")]
    inprocess.train([*plain, "--checkpoint-interval", "5"], signal_during_step=16, splits=inprocess.in_memory())
    assert "trackers" in torch_load(ckpt / "last.pt") and not torch_load(ckpt / "last.pt")["trackers"]
    inprocess.train(args(ckpt, store, "--resume"), splits=inprocess.in_memory())
    assert_mlflow_holds(store, ckpt)
    assert_wandb_holds(ckpt)


def torch_load(path: Path) -> dict:
    from conftest import load_checkpoint

    return load_checkpoint(path)


def test_a_tracker_that_fails_mid_run_warns_once_and_training_goes_on(tmp_path, capsys):
    """MLflow's store goes away at step 5 (its folder removed): one warning, the run trains to its end, W&B keeps
    every step."""
    store, ckpt = tmp_path / "mlruns", tmp_path / "ckpt"

    def store_gone_at_step_5(trainer) -> None:
        at_step_end = trainer.checkpointer.at_step_end

        def removing(step: int, stop_requested: bool):
            if step == 5:
                shutil.rmtree(store)
            return at_step_end(step, stop_requested)

        trainer.checkpointer.at_step_end = removing

    outcome = inprocess.train(args(ckpt, f"file:{store}"), before_fit=store_gone_at_step_5,
                              splits=inprocess.in_memory())
    assert outcome.final_step == EPOCHS * STEPS_PER_EPOCH
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: --mlflow file:{store} failed, training goes on without it: "), warnings
    assert_wandb_holds(ckpt)  # the other tracker goes on
    assert json.loads((ckpt / STEPS).read_text().splitlines()[-1])["step"] == EPOCHS * STEPS_PER_EPOCH


@pytest.mark.parametrize("option, value, says", [
    ("--mlflow", "sqlite:////proc/no/such/folder/mlflow.db", "--mlflow sqlite:////proc/no/such/folder/mlflow.db: "
                                                             "cannot use this MLflow store"),
    ("--mlflow", "file:/proc/mlruns", "--mlflow file:/proc/mlruns: cannot use this MLflow store"),
    ("--wandb", "team/project", "--wandb team/project: a W&B project name"),
])
def test_a_tracker_that_cannot_be_written_is_one_line_before_training(tmp_path, image_folder, option, value, says):
    ckpt = tmp_path / "ckpt"
    done = inprocess.command([str(image_folder), *SMALL_RUN, "--epochs", "1", "--checkpoints-path", str(ckpt),
                              option, value])
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if not line.startswith("warning: ")]
    assert errors == [errors[0]] and errors[0].startswith(f"imagenet-elastic: error: {says}"), done.stderr
    assert "Traceback" not in done.stderr and not (ckpt / STEPS).exists() and not (ckpt / "last.pt").exists()


def test_mlflows_file_store_is_refused_in_one_line_that_says_how_to_allow_it(tmp_path, image_folder, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    done = inprocess.command([str(image_folder), "--checkpoints-path", str(tmp_path / "ckpt"), "--mlflow",
                              f"file:{tmp_path}/mlruns"])
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("imagenet-elastic: error: "), done.stderr
    # the flag and its store; the two ways out: the variable that allows it, or another store
    assert_names(errors[0], f"--mlflow file:{tmp_path}/mlruns", "MLFLOW_ALLOW_FILE_STORE=true", "sqlite:///PATH")


@pytest.fixture
def wandb_settings_read_again():
    """wandb reads its settings from the environment once per process, at its first run: again after this."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_online_without_an_account_is_one_line_before_training(tmp_path, monkeypatch, wandb_settings_read_again):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(UserError, match=r"^--wandb tests: No API key configured"):
        inprocess.train(args(ckpt, f"file:{tmp_path}/mlruns"), splits=inprocess.in_memory())
    assert not (ckpt / STEPS).exists() and not (ckpt / "last.pt").exists()


def test_a_missing_package_names_its_extra(tmp_path, image_folder, monkeypatch):
    find_spec = sinks.importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name))
    done = inprocess.command([str(image_folder), "--checkpoints-path", str(tmp_path), "--wandb", "tests"])
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("imagenet-elastic: error: "), done.stderr
    assert_names(errors[0], "--wandb", "wandb", 'pip install "imagenet_elastic[wandb]"')  # the flag, package, extra


@pytest.mark.slow
def test_a_sigkilled_run_resumed_is_one_run_in_both_trackers_with_every_step_once(tmp_path, image_folder, warm_python):
    """The real thing: a process SIGKILLed mid-epoch, steps past its last checkpoint logged, W&B's service left to
    notice; the same command again continues both runs. The process: a fork of the warm python."""
    store, ckpt = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "ckpt"
    command = python_cmd(str(image_folder), *args(ckpt, store, "--checkpoint-interval", "5", "--resume")[1:],
                         python=warm_python)
    code, output = run_and_kill(command, when="epoch 2/2 step 6/", victim=lambda proc: proc.pid)
    assert code == -signal.SIGKILL, output
    assert max(steps_jsonl(ckpt)) > 15  # logged past the checkpoint at step 15
    resumed = run(command)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert_mlflow_holds(store, ckpt)
    assert_wandb_holds(ckpt)


@pytest.mark.slow
def test_a_process_without_wandb_leaves_the_client_that_timm_would_import_unloaded(tmp_path, image_folder):
    """timm imports the W&B client wherever it is installed (~0.5 s of every rank's start); the command's
    process (cli.program) makes that import fail unless --wandb asks for the client, which the SIGKILL test
    above then uses for real."""
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('loaded:', sorted(m for m in ('timm', 'wandb') if sys.modules.get(m))))\n"
             "from imagenet_elastic.cli import program\n"
             "sys.argv[0] = 'imagenet-elastic'\n"
             "program()\n")
    done = run([python_cmd()[0], "-c", probe, str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1",
                "--max-steps-per-epoch", "1", "--checkpoints-path", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "loaded: ['timm']"

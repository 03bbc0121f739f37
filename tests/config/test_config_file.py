"""--config FILE.yaml, --print-config and config.yaml: one form, read and written, the command line on top."""

from __future__ import annotations

import dataclasses

import inprocess
import pytest
import yaml
from conftest import REPO, VAL_IMAGES, assert_names

from imagenet_elastic import cli
from imagenet_elastic.config import RESUME_AUTO, Config
from imagenet_elastic.config.yaml_file import read_settings, settings_yaml
from imagenet_elastic.errors import UserError
from imagenet_elastic.report.metrics import read as read_metrics

UNUSUAL = ["/data", "--model", "resnet18", "--scale", "0.25", "1", "--ratio", "0.5", "2", "--hflip", "0",
           "--auto-augment", "ta_wide", "--random-erase", "0.25", "--checkpoint-interval", "500,10m",
           "--preempt-signals", "SIGUSR2", "--no-channels-last", "--compile", "--resume", "--workers", "3"]


def write(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_printed_settings_read_back_as_the_same_config(tmp_path):
    config, _ = cli.parse(UNUSUAL)
    again, _ = cli.parse(["--config", write(tmp_path, settings_yaml(config))])
    assert again == config
    assert dataclasses.asdict(Config(data="/data")) != dataclasses.asdict(config)  # the round trip carried values


@pytest.mark.parametrize("interval", ["1234567s", "500,1.2345678s", "0.1s"])
def test_a_checkpoint_interval_reads_back_exactly(tmp_path, interval):
    config, _ = cli.parse(["/data", "--checkpoint-interval", interval])
    assert cli.parse(["--config", write(tmp_path, settings_yaml(config))])[0] == config


def test_defaults_read_back_as_the_defaults(tmp_path):
    config = Config(data="/d")
    assert cli.parse(["--config", write(tmp_path, settings_yaml(config))])[0] == config


def test_the_command_line_overrides_the_file_and_the_file_overrides_the_defaults(tmp_path):
    path = write(tmp_path, "batch-size: 32\nlr: 0.4\ncompile: true\nhflip: 0\nscale: [0.35, 1]\n")
    config, _ = cli.parse(["/data", "--config", path, "--lr", "0.2", "--no-compile"])
    assert (config.batch_size, config.lr, config.compile, config.hflip, config.scale) == (32, 0.2, False, 0.0,
                                                                                          (0.35, 1.0))
    assert config.epochs == Config(data="/data").epochs


def test_keys_may_use_dashes_or_underscores_and_data_may_come_from_the_file(tmp_path):
    config, _ = cli.parse(["--config", write(tmp_path, "data: /from/file\nbatch_size: 16\nweight-decay: 0.05\n")])
    assert (config.data, config.batch_size, config.weight_decay) == ("/from/file", 16, 0.05)
    assert cli.parse(["/cli", "--config", write(tmp_path, "data: /from/file\n")])[0].data == "/cli"


def test_an_empty_file_changes_nothing(tmp_path):
    assert cli.parse(["/data", "--config", write(tmp_path, "# nothing yet\n")])[0] == Config(data="/data")


@pytest.mark.parametrize(("text", "message"), [
    ("bach-size: 3\n", "unknown option 'bach-size' (did you mean batch-size?)"),
    ("config: other.yaml\n", "unknown option 'config'"),
    ("- batch-size\n", "expected option names and values, got a list"),
    ("batch-size: [1\n", "is not valid YAML"),
    ("compile: maybe\n", "compile must be true or false, got 'maybe'"),
    ("scale: 0.5\n", "scale takes a list of 2 values, got 0.5"),
    ("epochs:\n", "epochs needs a value"),
    (b"model: \xff\xfe\n", "is not UTF-8 text (invalid start byte: byte 0xff)"),
    ("epochs: 2\nepochs: 3\n", "epochs is set twice (lines 1 and 2)"),
    ("batch-size: 8\nlr: 0.1\nbatch_size: 16\n", "batch-size is set twice (lines 1 and 3)"),
    ("val-labels: [a.csv]\n", "val-labels takes one value, not a list"),
    ("data: [/a, /b]\n", "data takes one value, not a list"),
    ("model: {name: resnet50}\n", "model takes one value, not a mapping"),
    ("progressive-resize: {low: 16}\n", "progressive-resize takes one value, not a mapping"),
    ("model: yes\n", "model takes a value, not true"),
    ("ratio: [1, 0.5]\n", "--ratio: MIN must not exceed MAX"),
    ("scale: [0.5, 2]\n", "--scale: at most 1"),
])
def test_a_bad_file_is_one_user_error_naming_the_file(tmp_path, text, message):
    if isinstance(text, bytes):
        (tmp_path / "config.yaml").write_bytes(text)
        path = str(tmp_path / "config.yaml")
    else:
        path = write(tmp_path, text)
    with pytest.raises(UserError) as raised:
        cli.parse(["/data", "--config", path])
    assert path in str(raised.value) and message in str(raised.value)


@pytest.mark.parametrize(("text", "message"), [
    ("batch-size: 0\n", "argument --batch-size: must be >= 1, got 0"),
    ("auto-augment: fancy\n", "argument --auto-augment: invalid choice: 'fancy'"),
    ("hflip: 2\n", "argument --hflip: must be <= 1.0, got 2"),
    ("lr: .nan\n", "argument --lr: must be a finite number, got nan"),
])
def test_a_bad_value_in_a_file_fails_as_on_the_command_line_naming_the_file(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as raised:
        cli.parse(["/data", "--config", path])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert f"config file {path}: {message}" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("text", "resume"), [
    ("resume: true\n", RESUME_AUTO), ("resume: false\n", None), ("resume: runs/a/last.pt\n", "runs/a/last.pt"),
    ("resume: 'true'\n", "true"),
])
def test_resume_true_in_a_file_is_the_bare_flag_and_false_no_resume(tmp_path, monkeypatch, text, resume):
    """Not the paths `True` and `False`; a string is a path, as on the command line."""
    monkeypatch.chdir(tmp_path)
    for path in ("runs/a/last.pt", "true"):  # a path that names nothing is refused (test_a_files_bad_setting_...)
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    assert cli.parse(["/data", "--config", write(tmp_path, text)])[0].resume == resume


@pytest.mark.parametrize(("text", "key", "message"), [
    ("resume: nosuch\n", "resume", "--resume nosuch"),
    ("progressive-resize: [16, 24]\n", "progressive-resize", "--progressive-resize needs --progressive-epochs"),
    ("pretrained: true\ninitial-checkpoint: a.pt\n", "initial-checkpoint, pretrained", "--pretrained"),
])
def test_a_files_bad_setting_found_once_merged_names_the_file_and_the_key(tmp_path, monkeypatch, text, key, message):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, text)
    with pytest.raises(UserError) as raised:
        cli.parse(["/data", "--config", path])
    assert_names(str(raised.value), path, key, message)
    assert len(str(raised.value).splitlines()) == 1


@pytest.mark.parametrize(("text", "flag"), [
    ("progressive-resize: [16, 32]\nprogressive-epochs: [0, 2]\n", "--progressive-resize"),
    ("val-crop-size: 48\n", "--val-crop-size"), ("global-batch-size: 64\n", "--global-batch-size"),
    ("checkpoint-interval: 500,10m\n", "--checkpoint-interval"),
])
def test_none_on_the_command_line_unsets_a_files_optional_setting(tmp_path, text, flag):
    unset = ["--progressive-epochs", "none"] if flag == "--progressive-resize" else []
    config, _ = cli.parse(["/data", "--config", write(tmp_path, text), flag, "None", *unset])
    assert config == Config(data="/data")


def test_a_bad_setting_given_on_the_command_line_beside_a_file_names_no_file(tmp_path):
    path = write(tmp_path, "epochs: 3\n")
    with pytest.raises(UserError) as raised:
        cli.parse(["/data", "--config", path, "--progressive-resize", "16,24"])
    assert "--progressive-resize" in str(raised.value) and path not in str(raised.value)


def test_a_files_value_refused_by_the_build_names_the_file_and_the_key(image_folder, tmp_path):
    """`model: nosuch` passes the parse (any timm name may exist) and is refused when the model is built."""
    path = write(tmp_path, "model: nosuch\n")
    result = inprocess.command([str(image_folder), "--config", path, "--workers", "0",
                                "--checkpoints-path", str(tmp_path / "ck")])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"imagenet-elastic: error: config file {path} sets model: --model 'nosuch'"), line
    given = inprocess.command([str(image_folder), "--config", path, "--model", "nosuch", "--workers", "0",
                               "--checkpoints-path", str(tmp_path / "ck")])
    assert given.returncode == 2 and path not in given.stderr and "--model 'nosuch'" in given.stderr


def test_a_files_value_refused_by_the_launcher_names_the_file_and_the_key(tmp_path, monkeypatch):
    """The launch is resolved after the parse, before any rank starts."""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    path = write(tmp_path, "dist-init-method: mpi\ndist-url: nonsense\n")
    result = inprocess.command(["/data", "--config", path])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"imagenet-elastic: error: config file {path} sets dist-url: --dist-url 'nonsense'"), line


def test_a_null_in_the_file_is_no_setting_of_its_and_is_never_named(tmp_path):
    """`--print-config > run.yaml` writes every setting, most of them null: an error that mentions such a flag, here
    as advice, does not blame the file for it."""
    path = write(tmp_path, "progressive-resize: null\nval-path: null\nepochs: 4\n")
    with pytest.raises(UserError) as raised:
        cli.parse(["/data", "--config", path, "--progressive-epochs", "1,2"])
    assert path not in str(raised.value) and "--progressive-resize" in str(raised.value)
    assert cli.parse(["/data", "--config", path])[1].file_only == {"epochs": 4}


def test_a_files_path_named_by_its_value_names_the_file_and_the_key(tmp_path):
    """DATA has no flag: an error names it by its folder. So does --evaluate's damaged checkpoint."""
    missing = tmp_path / "nosuch"
    path = write(tmp_path, f"data: {missing}\n")
    result = inprocess.command(["--config", path, "--workers", "0", "--checkpoints-path", str(tmp_path / "ck")])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert_names(line, f"config file {path} sets data:", missing)
    damaged = tmp_path / "bad.pt"
    damaged.write_bytes(b"not a checkpoint")
    path = write(tmp_path, f"evaluate: true\nresume: {damaged}\n")
    result = inprocess.command(["/data", "--config", path])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert_names(line, f"config file {path} sets resume:", damaged)


def test_naming_the_file_keeps_the_errors_class_and_exit_code():
    from imagenet_elastic.config.yaml_file import named_by_file
    from imagenet_elastic.errors import StorageError

    file_only = {"checkpoints_path": "full"}
    error = named_by_file(StorageError("--checkpoints-path /full: no space left"), "run.yaml", file_only)
    assert type(error) is StorageError and error.exit_code == 74
    assert str(error) == "config file run.yaml sets checkpoints-path: --checkpoints-path /full: no space left"
    assert str(named_by_file(error, "run.yaml", file_only)) == str(error)  # named once
    assert str(named_by_file(UserError("--lr 5 is too high"), "run.yaml", {"epochs": 5})) == "--lr 5 is too high"
    paths = {"data": "/d", "val_labels": "/d/labels.csv"}  # a flag named is the culprit, not a path inside its value
    said = str(named_by_file(UserError("--val-labels /d/labels.csv does not exist"), "run.yaml", paths))
    assert said.startswith("config file run.yaml sets val-labels: ")


def test_a_bare_resume_on_the_command_line_overrides_a_files_resume_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the file's path names nothing: only the command line's bare flag counts
    assert cli.parse(["/data", "--config", write(tmp_path, "resume: nosuch.pt\n"), "--resume"])[0].resume == RESUME_AUTO


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_a_files_resume_naming_nothing_beside_a_last_pt_is_refused_unless_a_restart_continues_it(tmp_path, monkeypatch,
                                                                                                 restarts):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "last.pt").touch()
    argv = ["/data", "--config", write(tmp_path, "resume: missing.pt\n"), "--checkpoints-path", "ck"]
    if restarts == "0":
        with pytest.raises(UserError) as raised:
            cli.parse(argv)
        assert_names(str(raised.value), "resume", "missing.pt")
    else:
        assert cli.parse(argv)[0].resume == "missing.pt"  # store.resume_path continues ck/last.pt


def test_resume_true_in_a_file_keeps_the_files_data_folder(tmp_path):
    config, _ = cli.parse(["--config", write(tmp_path, "resume: true\ndata: /from/file\n")])
    assert (config.resume, config.data) == (RESUME_AUTO, "/from/file")


def test_a_yaml_merge_key_gives_its_settings(tmp_path):
    config, _ = cli.parse(["/data", "--config", write(tmp_path, "<<: {lr: 0.3, epochs: 7}\nepochs: 4\n")])
    assert (config.lr, config.epochs) == (0.3, 4)  # a key beside the merge wins, as YAML says


def test_an_empty_list_of_preempt_signals_means_none(tmp_path):
    """The empty set of signals, as `none` says it and --print-config writes it."""
    config, _ = cli.parse(["/data", "--config", write(tmp_path, "preempt-signals: []\n")])
    assert config.preempt_signals == () == cli.parse(["/data", "--preempt-signals", "none"])[0].preempt_signals


def test_a_missing_file_is_named():
    with pytest.raises(UserError) as caught:
        cli.parse(["/data", "--config", "/no/such.yaml"])
    assert_names(str(caught.value), "config file", "/no/such.yaml", "No such file or directory")


def test_a_second_config_file_is_refused_naming_both_not_the_last_taken(tmp_path):
    first, second = write(tmp_path, "batch-size: 16\n"), str(tmp_path / "other.yaml")
    (tmp_path / "other.yaml").write_text("batch-size: 32\n")
    result = inprocess.command(["/data", "--config", first, "--config", second, "--print-config"])
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert_names(line, "--config", first, second)


@pytest.mark.parametrize("argv", [["--config="], ["--config", ""]])
def test_an_empty_config_is_refused_not_read_as_none(argv):
    result = inprocess.command(["/data", *argv, "--print-config"])
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert_names(line, "--config", "empty")


def test_print_config_prints_yaml_and_needs_no_data_folder(capsys):
    cli.main(["--print-config", "--batch-size", "48", "--hflip", "0.2"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["batch-size"] == 48 and printed["hflip"] == 0.2 and printed["data"] is None
    assert set(printed) == {f.name.replace("_", "-") for f in dataclasses.fields(Config)}


def test_read_settings_returns_only_what_the_file_sets(tmp_path):
    values = read_settings(write(tmp_path, "epochs: 3\nval-path:\n"), cli.build_parser())
    assert values == {"epochs": 3, "val_path": None}


RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_shipped_recipe_names_its_source_and_published_result_and_parses(recipe):
    text = recipe.read_text()
    assert "Source" in text and "published" in text.lower()
    config, _ = cli.parse(["/data", "--config", str(recipe)])
    assert config.data == "/data"


def test_the_recipes_the_issue_names_are_shipped_with_their_key_settings():
    recipes = {r.stem: cli.parse(["/data", "--config", str(r)])[0] for r in RECIPES}
    v2 = recipes["resnet50_torchvision_v2"]
    assert (v2.mixup_alpha, v2.cutmix_alpha, v2.auto_augment, v2.random_erase, v2.ra_reps, v2.model_ema) == \
        (0.2, 1.0, "ta_wide", 0.1, 4, True)
    assert (v2.model_ema_decay, v2.model_ema_steps) == (0.998908, 32)
    assert (v2.image_size, v2.eval_crop, v2.eval_resize, v2.epochs) == (176, 224, 232, 600)
    for name, epochs, ramp in (("ffcv_resnet50_16ep", 16, (11, 13)), ("ffcv_resnet50_88ep", 88, (65, 76)),
                               ("ffcv_resnet18_16ep", 16, (11, 13))):
        ffcv = recipes[name]
        assert (ffcv.epochs, ffcv.progressive_resize, ffcv.progressive_epochs, ffcv.sched, ffcv.val_flip_average,
                ffcv.blurpool) == (epochs, (160, 192), ramp, "linear", True, True)
    assert recipes["resnet50_baseline_90ep"].sched == "step" and not recipes["resnet50_torchvision_v2"].blurpool


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_shipped_recipe_trains_and_validates_an_epoch_with_a_tiny_model(recipe, image_folder, tmp_path):
    """Each recipe's combination of options, at its own image sizes, through a step-capped epoch."""
    result = inprocess.command([str(image_folder), "--config", str(recipe), "--model", "test_resnet", "--batch-size",
                                "8", "--global-batch-size", "16", "--epochs", "1", "--max-steps-per-epoch", "2",
                                "--workers", "0", "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert (row["epoch"], row["val_samples"], row["global_batch"]) == (1, VAL_IMAGES, 16)


def test_a_runs_config_yaml_reruns_its_settings_as_a_new_run(tmp_path):
    """config.yaml leaves out where the run lives: with it, `--config` would have resumed (or been refused by) the
    old folder instead of running the same settings again."""
    from imagenet_elastic.config import yaml_file

    ran = Config(data="/data/imagenet", lr=0.3, epochs=7, checkpoints_path=str(tmp_path / "old"), resume="auto")
    yaml_file.write(str(tmp_path), ran)
    keys = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert "checkpoints-path" not in keys and "resume" not in keys and keys["lr"] == 0.3
    again, _ = cli.parse(["--config", str(tmp_path / "config.yaml"), "--checkpoints-path", str(tmp_path / "new")])
    assert again == dataclasses.replace(ran, checkpoints_path=str(tmp_path / "new"), resume=None)


def test_a_runs_config_yaml_holds_its_relative_paths_absolute_so_it_reruns_from_anywhere(tmp_path, monkeypatch):
    from imagenet_elastic.config import yaml_file

    (tmp_path / "data" / "val").mkdir(parents=True)
    (tmp_path / "teacher.pt").write_bytes(b"weights")
    monkeypatch.chdir(tmp_path)
    yaml_file.write(str(tmp_path), Config(data="data", val_path="data/val", teacher="teacher.pt",
                                          initial_checkpoint="absent.pt"))
    keys = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (keys["data"], keys["val-path"], keys["teacher"]) == (
        str(tmp_path / "data"), str(tmp_path / "data" / "val"), str(tmp_path / "teacher.pt"))
    assert keys["initial-checkpoint"] == "absent.pt"  # no such path here: written as given


def test_a_home_folders_tilde_in_a_files_paths_is_expanded_as_a_shell_expands_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "run.yaml").write_text("data: ~/imagenet\ncheckpoints-path: ~/runs/r1\nteacher: ~/teacher.pt\n")
    config, _ = cli.parse(["--config", str(tmp_path / "run.yaml")])
    home = tmp_path / "home"
    assert (config.data, config.checkpoints_path, config.teacher) == (
        str(home / "imagenet"), str(home / "runs" / "r1"), str(home / "teacher.pt"))

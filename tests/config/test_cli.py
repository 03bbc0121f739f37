"""The frozen Config and the command line built from its fields."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import inprocess
import pytest
import torch
from conftest import REPO, assert_names, child_env, single_line

from imagenet_elastic import cli
from imagenet_elastic.checkpoint.store import CheckpointFolder
from imagenet_elastic.cli import build_parser, config_from_args
from imagenet_elastic.config import RESUME_AUTO, RESUME_SENSITIVE, VALIDATION_SENSITIVE, Config
from imagenet_elastic.errors import UserError
from imagenet_elastic.options import checkpoint_interval

# ----------------------------------------------------------------------------- Config

def test_config_differences_lists_only_changed_resume_sensitive_settings():
    saved = Config(data="/a", lr=0.1, batch_size=64, workers=4, log_interval=10).to_dict()
    now = Config(data="/b", lr=0.2, batch_size=32, workers=8, log_interval=99)
    differences = now.differences(saved)
    assert differences == ["lr: checkpoint 0.1, now 0.2", "batch_size: checkpoint 64, now 32"]  # in field order


def test_config_differences_is_empty_for_the_same_settings_and_ignores_missing_keys():
    config = Config(data="/a")
    assert config.differences(config.to_dict()) == []
    assert config.differences({}) == []
    assert config.differences({"seed": 1, "unknown": 5}) == ["seed: checkpoint 1, now 0"]


def test_evaluate_is_told_only_of_the_differences_that_change_validation():
    saved = Config(data="/a", lr=0.1, batch_size=64, image_size=176, amp="bf16").to_dict()
    now = Config(data="/a", evaluate=True, lr=0.2, batch_size=32, image_size=224, amp="none")
    assert now.differences(saved, VALIDATION_SENSITIVE) == ["image_size: checkpoint 176, now 224",
                                                             "amp: checkpoint 'bf16', now 'none'"]


def test_resume_sensitive_settings_are_those_whose_fields_say_exact_and_validation_ones_are_fields():
    """A setting says itself that a change breaks exact continuation (`option(..., exact=True)`), beside its flag."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert set(VALIDATION_SENSITIVE) <= set(fields)
    assert tuple(name for name, f in fields.items() if f.metadata.get("exact")) == RESUME_SENSITIVE
    assert {"lr", "opt", "seed", "scale", "progressive_resize", "model_ema"} <= set(RESUME_SENSITIVE)
    assert not {"workers", "log_interval", "checkpoints_path", "decode", "dist_timeout"} & set(RESUME_SENSITIVE)


def test_config_to_dict_round_trips_through_torch_save_weights_only():
    config = Config(data="/data", val_path="/v", model="resnet18", max_steps_per_epoch=5, channels_last=True,
                    warmup_epochs=0.5, resume=RESUME_AUTO)
    buffer = io.BytesIO()
    torch.save({"config": config.to_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["config"]
    assert loaded == config.to_dict()
    assert Config(**loaded) == config


def test_config_eval_resize_defaults_to_size_over_0875():
    assert Config(data="x").eval_resize == 256
    assert Config(data="x", image_size=160).eval_resize == round(160 / 0.875)
    assert Config(data="x", val_resize=300).eval_resize == 300


def test_val_crop_size_sets_the_val_crop_and_its_default_resize():
    fixres = Config(data="x", image_size=176, val_crop_size=224)
    assert (fixres.eval_crop, fixres.eval_resize) == (224, 256)
    assert Config(data="x", image_size=176, val_crop_size=224, val_resize=232).eval_resize == 232
    assert Config(data="x", image_size=176).eval_crop == 176


# ----------------------------------------------------------------------------- command line

def parse(*argv: str) -> Config:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_parser_defaults_equal_config_defaults():
    assert parse("/data") == Config(data="/data")


def test_config_from_args_is_frozen_and_carries_the_flags():
    config = parse("/data", "--batch-size", "32", "--lr", "0.5", "--model", "resnet18", "--no-channels-last",
                   "--max-steps-per-epoch", "7", "--local-rank", "2", "--amp", "bf16")
    assert (config.batch_size, config.lr, config.model, config.channels_last) == (32, 0.5, "resnet18", False)
    assert config.max_steps_per_epoch == 7
    assert config.amp == "bf16"
    assert not hasattr(config, "local_rank")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]


def test_local_rank_is_parsed_in_both_spellings():
    parser = build_parser()
    assert parser.parse_args(["/d", "--local-rank", "3"]).local_rank == 3
    assert parser.parse_args(["/d", "--local_rank=1"]).local_rank == 1
    assert parser.parse_args(["/d"]).local_rank is None


def test_resume_without_a_value_means_auto():
    assert parse("/data", "--resume").resume == RESUME_AUTO == "auto"
    assert parse("/data", "--resume", "/ck/epoch_0003.pt").resume == "/ck/epoch_0003.pt"
    assert parse("/data").resume is None


def saved_run(path: Path, **settings) -> Path:
    """A checkpoint as far as --evaluate's parse reads it: the model's name and the run's settings."""
    config = Config(data="/a", **settings)
    torch.save({"model": {}, "epoch": 1, "model_name": config.model, "config": config.to_dict()}, path)
    return path


def test_evaluate_takes_the_model_its_blur_and_validation_sizes_from_the_checkpoint_unless_given(tmp_path):
    checkpoint = saved_run(tmp_path / "best.pt", model="hf-hub:someone/net", pretrained=True, blurpool=True,
                           image_size=176, val_crop_size=224, val_resize=256, lr=3.0)
    config, _ = cli.parse(["/data", "--evaluate", "--resume", str(checkpoint)])
    assert (config.model, config.pretrained, config.blurpool, config.image_size, config.val_crop_size,
            config.val_resize) == ("hf-hub:someone/net", True, True, 176, 224, 256)
    assert config.lr == Config(data="/a").lr  # the training's settings stay as given: they do not validate
    (tmp_path / "recipe.yaml").write_text("val-resize: 240\n")
    config, _ = cli.parse(["/data", "--evaluate", "--resume", str(checkpoint), "--model", "resnet18", "--image-size",
                       "160", "--no-blurpool", "--config", str(tmp_path / "recipe.yaml")])
    assert (config.model, config.blurpool, config.image_size, config.val_crop_size, config.val_resize) == (
        "resnet18", False, 160, 224, 240)  # the build then refuses another model than the checkpoint's, in one line
    (tmp_path / "ckpt").mkdir()
    saved_run(tmp_path / "ckpt" / "last.pt", model="test_resnet")
    config, _ = cli.parse(["/data", "--evaluate", "--resume", "--checkpoints-path", str(tmp_path / "ckpt")])
    assert config.model == "test_resnet"  # a bare --resume: CHECKPOINTS/last.pt
    assert cli.parse(["/data", "--resume", str(checkpoint)])[0].model == "resnet50"  # training: as given


def test_batch_size_zero_exits_2_with_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["/data", "--batch-size", "0"])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "--batch-size" in lines[0]
    assert lines[0].startswith("imagenet-elastic: error: ")
    assert "usage:" not in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(("flag", "value"), [("--lr", "0"), ("--lr", "abc"), ("--momentum", "-1"),
                                             ("--epochs", "1.5"), ("--workers", "-2"),
                                             # nan passes every comparison; inf is no rate, probability or time
                                             ("--lr", "nan"), ("--hflip", "nan"), ("--label-smoothing", "nan"),
                                             ("--cutmix-alpha", "inf"), ("--warmup-epochs", "inf"),
                                             ("--dist-timeout", "nan"), ("--momentum", "nan")])
def test_bad_numeric_flags_exit_2_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["/data", flag, value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert flag in err


def test_two_loss_weights_of_0_exit_2_naming_both():
    finished = inprocess.command(["/data", "--teacher", "t", "--task-loss-weight", "0", "--distill-loss-weight", "0"])
    assert finished.returncode == 2 and len(finished.stderr.strip().splitlines()) == 1, finished.stderr
    assert "--task-loss-weight 0" in finished.stderr and "--distill-loss-weight 0" in finished.stderr
    assert Config(data="/data", teacher="t", task_loss_weight=0.0, distill_loss_weight=0.5).teacher == "t"


def test_an_integer_flag_takes_an_integer_too_large_for_a_float():
    """The finite-number check is for floats: an int of 400 digits has no float, and asking would raise OverflowError,
    which argparse does not turn into its one line."""
    args = build_parser().parse_args(["/data", "--max-steps-per-epoch", "1" + "0" * 400])
    assert args.max_steps_per_epoch == 10 ** 400


@pytest.mark.parametrize(("flag", "value"), [
    ("--seed", "1" + "0" * 20), ("--seed", str(2**64)),  # torch.manual_seed: overflow
    ("--threads", "1" + "0" * 20), ("--nproc-per-node", "5000"),  # torch.set_num_threads: overflow; a fork bomb
    ("--label-smoothing", "1.5"),  # torch's cross-entropy refuses it at the first step
    ("--image-size", "100000"), ("--val-crop-size", "5000"), ("--val-resize", "1" + "0" * 20),  # out of memory
    ("--progressive-resize", "32,100000"), ("--workers", "1000"),  # out of memory; the OOM killer
    ("--epochs", "1" + "0" * 30),  # start-up went over every epoch's training size: no end, deaf to SIGTERM
])
def test_values_torch_or_the_machine_cannot_take_exit_2_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["/data", flag, value])
    assert caught.value.code == 2
    assert_names(single_line(capsys.readouterr().err), flag, value)


@pytest.mark.parametrize(("flag", "largest"), [
    ("--batch-size", 2**20), ("--global-batch-size", 2**20), ("--log-interval", 10**9), ("--ra-reps", 64),
    ("--model-ema-steps", 10**9), ("--keep-checkpoints", 10**6), ("--progressive-epochs", "0,100000"),
    ("pack --max-side", 65535),
])
def test_a_size_beyond_its_bound_exits_2_naming_the_flag_and_the_bound_itself_is_taken(capsys, flag, largest):
    """Sizes without an upper bound ended in an overflow or out-of-memory traceback, far into the run."""
    from imagenet_elastic.tools import pack

    parser, words = (pack.build_parser(), ["SRC", "OUT"]) if flag.startswith("pack ") else (build_parser(), ["/data"])
    name = flag.split()[-1]
    too_large = str(largest + 1) if isinstance(largest, int) else "0,100001"
    assert getattr(parser.parse_args([*words, name, str(largest)]), name[2:].replace("-", "_")) is not None
    with pytest.raises(SystemExit) as caught:
        parser.parse_args([*words, name, too_large])
    assert caught.value.code == 2
    assert_names(single_line(capsys.readouterr().err), name, too_large)


def test_the_largest_values_a_bound_allows_are_taken():
    args = build_parser().parse_args(["/data", "--seed", str(2**64 - 1), "--threads", "1024", "--label-smoothing", "1",
                                      "--image-size", "4096", "--val-resize", "4096", "--workers", "128",
                                      "--progressive-resize", "32,4096", "--epochs", "100000"])
    assert (args.seed, args.threads, args.label_smoothing, args.image_size, args.val_resize, args.workers,
            args.progressive_resize, args.epochs) == (2**64 - 1, 1024, 1.0, 4096, 4096, 128, (32, 4096), 100000)


@pytest.mark.parametrize("text,expected", [
    ("500", (500, None)), ("10m", (None, 600.0)), ("90s", (None, 90.0)), ("2h", (None, 7200.0)),
    ("500,10m", (500, 600.0)), ("0.5m", (None, 30.0)),
])
def test_checkpoint_interval_takes_steps_time_or_both(text, expected):
    assert checkpoint_interval(text) == expected


@pytest.mark.parametrize("text", ["0", "-5", "10x", "m", "", "5,", "0s", "nans", "infm", "1e400s"])
def test_bad_checkpoint_interval_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        checkpoint_interval(text)


@pytest.mark.parametrize("text", ["500,500", "1m,2m", "500,1m,2m", "10m,500,90s"])
def test_two_step_counts_or_two_times_in_one_checkpoint_interval_are_refused(text):
    """One of the two would be dropped unsaid."""
    with pytest.raises(argparse.ArgumentTypeError, match=text):
        checkpoint_interval(text)


def test_checkpoint_interval_reaches_the_config():
    config = config_from_args(build_parser().parse_args(["/data", "--checkpoint-interval", "20,30s"]))
    assert (config.checkpoint_every_steps, config.checkpoint_every_seconds) == (20, 30.0)
    plain = config_from_args(build_parser().parse_args(["/data"]))
    assert (plain.checkpoint_every_steps, plain.checkpoint_every_seconds) == (None, None)


def test_every_setting_has_exactly_one_option_and_help_shows_them_all(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    shown = capsys.readouterr().out
    for f in dataclasses.fields(Config):
        if f.name != "data":
            assert "--" + f.name.replace("_", "-") in shown, f.name
    assert "--local-rank" not in shown  # accepted from torch.distributed.launch, never offered


def test_master_port_must_be_a_port(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["/data", "--master-port", "70000"])
    assert "must be <= 65535" in capsys.readouterr().err


def test_a_bare_resume_never_takes_the_data_folder(tmp_path):
    """`--resume /data/imagenet` used to resume from /data/imagenet and then say DATA is missing."""
    from imagenet_elastic import cli

    checkpoint = tmp_path / "best.pt"
    checkpoint.write_bytes(b"")
    assert cli.parse(["--resume", "/data/imagenet"])[0] == Config(data="/data/imagenet", resume=RESUME_AUTO)
    assert cli.parse(["/data/imagenet", "--resume", "--epochs", "3"])[0].resume == RESUME_AUTO
    assert cli.parse(["--resume", str(checkpoint), "/data/imagenet"])[0].resume == str(checkpoint)  # a file
    assert cli.parse(["/data", "--resume", "/runs/a/last.pt"])[0].resume == "/runs/a/last.pt"  # a .pt path
    assert cli.parse(["/data", "--resume=/runs/a/last"])[0].resume == "/runs/a/last"  # the explicit form, always


def test_resume_of_a_checkpoints_folder_takes_its_last_pt_and_goes_on_saving_there(tmp_path):
    """`--resume FOLDER` (FOLDER holding last.pt), in every order and form users write: FOLDER is the checkpoint's
    folder and, unless --checkpoints-path (or the --config file) says otherwise, the run's."""
    folder = tmp_path / "run1"
    folder.mkdir()
    (folder / "last.pt").write_bytes(b"")
    for argv in (["--resume", str(folder), "/data"], ["/data", "--resume", str(folder)],
                 ["/data", f"--resume={folder}"]):
        config = cli.parse(argv)[0]
        assert (config.data, config.resume, config.checkpoints_path) == ("/data", str(folder), str(folder)), argv
        manager = CheckpointFolder(config.checkpoints_path, 1)
        assert manager.resume_path(config.resume, restarted=False) == str(folder / "last.pt")
    config = cli.parse(["/data", "--resume", str(folder), "--checkpoints-path", str(tmp_path / "run2")])[0]
    assert (config.resume, config.checkpoints_path) == (str(folder), str(tmp_path / "run2"))
    (tmp_path / "run.yaml").write_text(f"checkpoints-path: {tmp_path / 'run3'}\n")
    config = cli.parse(["/data", "--resume", str(folder), "--config", str(tmp_path / "run.yaml")])[0]
    assert config.checkpoints_path == str(tmp_path / "run3")


@pytest.mark.parametrize("order", ["resume first", "data first"])
@pytest.mark.parametrize("made", ["empty folder", "nothing"])
def test_resume_of_a_word_that_is_no_checkpoint_beside_data_names_that_word(tmp_path, order, made):
    word = tmp_path / "run1"
    if made == "empty folder":
        word.mkdir()
    argv = ["--resume", str(word), "/data"] if order == "resume first" else ["/data", "--resume", str(word)]
    with pytest.raises(UserError, match=re.escape(f"--resume {word}: ")) as caught:
        cli.parse(argv)
    said = str(caught.value)
    assert ("without last.pt" if made == "empty folder" else "no such") in said and "beside /data" in said
    with pytest.raises(UserError, match=re.escape(f"--resume {word}: ")):
        CheckpointFolder(str(tmp_path / "ckpt"), 1).resume_path(str(word), restarted=False)  # `--resume=WORD`


def test_help_shows_every_default_as_the_command_line_writes_it_and_lists_the_other_commands(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag, default in (("--seed N", "0"), ("--lr-min X", "0"), ("--random-erase P", "0"),
                          ("--scale MIN MAX", "0.08 1"), ("--preempt-signals SIGNALS", "SIGTERM,SIGUSR1"),
                          ("--channels-last, --no-channels-last", "on")):
        assert re.search(rf"{re.escape(flag)} .*?\(default: {re.escape(default)}\)", text), flag
    for flag, default in (("--workers N", "cores per process - 1 (max 8; max 4 under --decode gpu)"),
                          ("--threads N", "cores / processes per node"),
                          ("--global-batch-size N", "checkpoint's, else batch-size x processes")):
        assert f"(default: {default})" in text, flag
    assert "(0.08, 1.0)" not in text and "(default: None)" not in text
    for command in ("benchmark", "evaluate", "export", "pack", "plot"):
        assert f"imagenet-elastic {command} " in text, command


def test_the_weight_decay_help_says_the_rule_the_optimizer_applies():
    from imagenet_elastic.optim.optimizer import param_groups

    field = next(f for f in dataclasses.fields(Config) if f.name == "weight_decay")
    assert "1-D parameters" in field.metadata["help"]
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(4)))  # 1-D, neither a norm nor a bias
    plain, decayed = param_groups(model, 0.1)  # timm's order
    assert [p.ndim for p in decayed["params"]] == [2] and len(plain["params"]) == 4


def test_the_package_imports_no_private_name_of_timm():
    """timm's `_hub` and the like move between releases; export uses `timm.models.save_for_hf`."""
    import ast

    package = REPO / "imagenet_elastic"
    private = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("timm"):
                names = [*(node.module or "").split("."), *(a.name for a in node.names)]
                private += [f"{path.name}: {node.module} {n}" for n in names if n.startswith("_")]
    assert private == []


def test_each_optimizer_and_launcher_brings_its_own_help_to_the_option_that_chooses_it():
    """A new entry of OPTIMIZERS or METHODS is one line where the list is kept: its help reaches --help unedited."""
    from imagenet_elastic.launch.launchers import METHODS
    from imagenet_elastic.optim.optimizer import OPTIMIZERS

    fields = {f.name: f.metadata["help"] for f in dataclasses.fields(Config)}
    for field, registry in (("opt", OPTIMIZERS), ("dist_init_method", METHODS)):
        for name, entry in registry.items():
            assert f"{name} ({entry.help})" in fields[field], (field, name)



def test_a_tracker_in_TRACKERS_is_a_setting_and_a_flag_with_its_own_help():
    """A new tracker is its module and a line in TRACKERS: its setting, flag and help follow, with no Config field."""
    from imagenet_elastic.report import sinks
    from imagenet_elastic.report.sinks.tracker import Tracker

    class Neptune(Tracker):
        option, metavar, help = "neptune", "PROJECT", "log to a Neptune project"

    made = {f.name: f.metadata for f in dataclasses.fields(sinks.tracker_settings({"neptune": Neptune}))}
    assert (made["neptune"]["help"], made["neptune"]["metavar"]) == ("log to a Neptune project", "PROJECT")
    assert {f.name for f in dataclasses.fields(sinks.TrackerSettings)} == set(sinks.TRACKERS) == {"wandb", "mlflow"}
    config = config_from_args(build_parser().parse_args(["data", "--wandb", "proj", "--mlflow", "file:./runs"]))
    assert (config.wandb, config.mlflow) == ("proj", "file:./runs")


def test_ctrl_c_in_a_command_is_one_line_naming_it_and_exit_130(monkeypatch):
    """As the trainer's: no traceback. The command's own work is stood in for by one that is interrupted."""
    from inprocess import command

    from imagenet_elastic.errors import INTERRUPTED_EXIT
    from imagenet_elastic.tools import evaluate

    def interrupted(_args):
        raise KeyboardInterrupt
    monkeypatch.setattr(evaluate, "run", interrupted)
    try:
        done = command(["evaluate", "model.pt", "val"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left the command: the interpreter would print its traceback")
    assert done.returncode == INTERRUPTED_EXIT and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "evaluate" in done.stderr


def ctrl_c_once(cmd: list[str], ready: str, stream: str, ignored: bool = False) -> subprocess.CompletedProcess:
    """`cmd` in a process group of its own, sent a SIGINT (as a terminal's Ctrl-C) once a line of `stream` ("out",
    "err") holds `ready`; the other stream is read whole after it ends. `ignored`: started with SIGINT ignored, as a
    script's `cmd &` starts it."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None)
    watched = proc.stdout if stream == "out" else proc.stderr
    try:
        seen = []
        for line in watched:
            seen.append(line)
            if ready in line:
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest, other = proc.communicate(timeout=120)
        if stream == "err":
            rest, other = other, rest
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert ready in "".join(seen), "".join(seen) + rest
    out, err = ("".join(seen) + rest, other) if stream == "out" else (other, "".join(seen) + rest)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
def test_ctrl_c_while_evaluate_scores_exits_130_with_one_line(tmp_path):
    """A real process and a real SIGINT; scoring is stood in for by a wait that says it started."""
    from imagenet_elastic.errors import INTERRUPTED_EXIT

    code = ("import runpy, sys, time; from imagenet_elastic.tools import evaluate; "
            "evaluate.run = lambda args: (print('scoring', flush=True), time.sleep(120)); "
            "sys.argv = ['imagenet_elastic', 'evaluate', 'model.pt', 'val']; "
            "runpy.run_module('imagenet_elastic', run_name='__main__')")
    done = ctrl_c_once([sys.executable, "-c", code], "scoring", "out")
    assert done.returncode == INTERRUPTED_EXIT and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "evaluate" in done.stderr


@pytest.mark.slow
def test_ctrl_c_while_torch_is_imported_exits_130_without_a_traceback():
    """`-X importtime` tells each import as it ends: the SIGINT comes once one of torch's modules is in, torch not."""
    from imagenet_elastic.errors import INTERRUPTED_EXIT

    done = ctrl_c_once([sys.executable, "-X", "importtime", "-m", "imagenet_elastic", "--help"], " torch.", "err")
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == INTERRUPTED_EXIT and not said and "usage" not in done.stdout, done.stderr[-3000:]


@pytest.mark.slow
def test_a_process_that_ignores_ctrl_c_goes_on_after_one_during_its_imports():
    done = ctrl_c_once([sys.executable, "-X", "importtime", "-m", "imagenet_elastic", "--help"], " torch.", "err",
                       ignored=True)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("command", [["evaluate"], ["export"], ["benchmark"], ["pack"], ["plot"],
                                     ["--evaluate", "--resume", "x.pt", "--checkpoints-path"]])
def test_a_compile_cache_variable_naming_a_file_stops_every_command_in_one_line(tmp_path, capsys, monkeypatch,
                                                                                 command):
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache" / "inductor"))
    with pytest.raises(SystemExit) as stop:
        cli.main([*command, str(tmp_path / "in"), str(tmp_path / "out")])
    assert stop.value.code == 2 and not (tmp_path / "out").exists()
    assert_names(capsys.readouterr().err, "TORCHINDUCTOR_CACHE_DIR", tmp_path / "cache")


@pytest.mark.parametrize("made", ["empty folder", "nothing"])
def test_resume_of_a_word_that_is_no_checkpoint_where_the_config_file_gives_data_names_that_word(tmp_path, made):
    word = tmp_path / "run1"
    if made == "empty folder":
        word.mkdir()
    (tmp_path / "run.yaml").write_text("data: /data/imagenet\n")
    with pytest.raises(UserError, match=re.escape(f"--resume {word}: ")) as caught:
        cli.parse(["--config", str(tmp_path / "run.yaml"), "--resume", str(word)])
    assert_names(str(caught.value), "without last.pt" if made == "empty folder" else "no such",
                 tmp_path / "run.yaml", "/data/imagenet")
    # a DATA before --resume replaces the file's; a bare --resume then resumes from CHECKPOINTS/last.pt if there
    assert cli.parse(["--config", str(tmp_path / "run.yaml"), str(word), "--resume"])[0].data == str(word)


@pytest.mark.slow  # a process: its stdout a pipe whose reader has gone
def test_output_into_a_pipe_whose_reader_stopped_ends_quietly_with_the_shells_code():
    reader, writer = os.pipe()
    os.close(reader)  # `imagenet-elastic --print-config DATA | head -0`
    try:
        finished = subprocess.run([sys.executable, "-m", "imagenet_elastic", "--print-config", "/data"], stdout=writer,
                                  stderr=subprocess.PIPE, text=True, env=child_env(), timeout=120)
    finally:
        os.close(writer)
    assert finished.returncode == 141 and finished.stderr == ""

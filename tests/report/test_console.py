"""Rank 0 speaks for the run, in lines that survive `grep`; a rank speaks for itself only about what
only it can see."""

from imagenet_elastic.report.console import Console


def test_start_up_table_in_a_log_keeps_every_value_on_one_line(capsys):
    long_path = "/tmp/pytest-of-root/pytest-105/test_time_based_checkpoint_interval_saves_mid_epoch0/ckpt"
    value = f"{long_path} (each epoch, every 500 steps, every 0.001 s)"
    Console(enabled=True).table("imagenet_elastic", [("checkpoints", value), ("world size", "2")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "imagenet_elastic"
    assert lines[1].split() == ["checkpoints", *value.split()]
    assert lines[2].split() == ["world", "size", "2"]


def test_only_an_enabled_console_prints(capsys):
    Console(enabled=False).table("imagenet_elastic", [("model", "resnet18")])
    Console(enabled=False).info("hello")
    assert capsys.readouterr().out == ""


def test_every_rank_warning_comes_from_any_rank_and_names_it(capsys):
    quiet = Console(enabled=False, rank=3)
    quiet.warn("said by rank 0 only")
    quiet.warn("x.png is a PNG file", every_rank=True)
    Console(enabled=True, rank=0).warn("y.png is a PNG file", every_rank=True)
    assert capsys.readouterr().err.splitlines() == ["warning: rank 3: x.png is a PNG file",
                                                    "warning: rank 0: y.png is a PNG file"]

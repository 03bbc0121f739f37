"""What rank 0 prints into log files must survive `grep`: no values wrapped across lines."""

from imagenet_elastic.console import Console


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

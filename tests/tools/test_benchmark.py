"""`imagenet-elastic benchmark`: one JSON object per mode with the fields the docs promise (not timings)."""

from __future__ import annotations

import os
import signal
import time

import inprocess
import pytest
from conftest import finish, json_lines, python_cmd, run, start


def benchmark_args(image_folder, *args: str) -> list[str]:
    return ["benchmark", str(image_folder), "--image-size", "32", "--batch-size", "8", "--workers", "1", "--batches",
            "2", *args]


def benchmark_cmd(image_folder, *args: str) -> list[str]:
    return python_cmd(*benchmark_args(image_folder, *args))


def benchmark(image_folder, *args: str) -> list[dict]:
    return json_lines(run(benchmark_cmd(image_folder, *args)))


@pytest.mark.slow  # a process: its loader workers fork
def test_loader_mode_compares_ours_with_the_textbook_pipeline(image_folder):
    (line,) = benchmark(image_folder, "--mode", "loader", "--rounds", "2")
    assert line["mode"] == "loader" and line["workers"] == 1 and line["batch_size"] == 8
    assert line["ours_images_per_sec"] > 0 and line["textbook_images_per_sec"] > 0
    # the benchmark divides the unrounded rates; these are rounded, so the last digit may be one off
    assert line["ratio"] == pytest.approx(line["ours_images_per_sec"] / line["textbook_images_per_sec"], abs=0.011)
    assert len(line["rounds"]["ours"]) == len(line["rounds"]["textbook"]) == 2
    assert line["peak_host_rss_mb"] > 0 and line["peak_gpu_mb"] is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_model_modes_train_on_synthetic_and_real_batches(image_folder):
    modes = [("--mode", "synthetic"), ("--mode", "end_to_end"), ("--mode", "end_to_end", "--decode", "gpu")]
    runs = [start(benchmark_cmd(image_folder, *mode, "--model", "test_resnet")) for mode in modes]  # side by side
    lines = [line for proc in runs for line in json_lines(finish(proc))]
    assert [line["mode"] for line in lines] == ["synthetic", "end_to_end", "end_to_end"]
    for line in lines:
        assert line["images_per_sec"] > 0 and line["model"] == "test_resnet" and line["device"] == "cpu"
        assert line["amp"] in ("bf16", "fp32") and line["amp_reason"].startswith("auto: this CPU has")
        assert line["compile"] is False and line["channels_last"] is True
    assert [line["decode"] for line in lines[1:]] == ["cpu", "gpu"]


@pytest.mark.slow  # a process: its loader workers fork
def test_loader_mode_on_a_pack_against_its_folder(image_folder, tmp_path):
    from makers import run_pack

    run_pack(str(image_folder), str(tmp_path / "pack"), "--shard-size", "32")
    (line,) = json_lines(run(benchmark_cmd(tmp_path / "pack", "--mode", "loader", "--rounds", "1", "--against",
                                           str(image_folder))))
    assert "textbook_images_per_sec" not in line and line["data"] == f"{tmp_path / 'pack' / 'train'} (3 shards)"
    (folder,) = line["against"]
    assert folder["data"] == str(image_folder / "train") and sorted(line["rounds"]) == ["against 0", "ours"]
    assert folder["ours_vs_this"] == pytest.approx(line["ours_images_per_sec"] / folder["images_per_sec"], abs=0.011)


def test_missing_data_folder_is_one_line(tmp_path):
    result = inprocess.command(["benchmark", str(tmp_path / "nope")])
    assert result.returncode == 2
    assert result.stderr.strip() == f"imagenet-elastic: error: data folder {tmp_path / 'nope'} does not exist"


@pytest.mark.parametrize("mode", ["device_ops", "index", "checkpoint", "reads"])
def test_the_modes_of_bench_benchmark_are_not_installed_ones(mode, tmp_path):
    result = inprocess.command(["benchmark", str(tmp_path), "--mode", mode])
    assert result.returncode == 2 and "invalid choice" in result.stderr and repr(mode) in result.stderr


def test_a_ctrl_c_while_a_batch_is_received_takes_effect_once_it_has_arrived():
    from imagenet_elastic.tools.throughput import received_whole

    arrived = []

    def batches():
        os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C while a worker hands a batch over
        time.sleep(0.05)  # where the handler runs
        arrived.append("batch")
        yield "batch"

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        received_whole(batches())
    assert arrived == ["batch"] and signal.getsignal(signal.SIGINT) is before


def test_a_second_ctrl_c_while_a_late_batch_is_awaited_stops_at_once():
    from imagenet_elastic.tools.throughput import received_whole

    arrived = []

    def late_batches():
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        arrived.append("batch")  # a stalled store's, minutes later
        yield "batch"

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        received_whole(late_batches())
    assert arrived == [] and signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow  # forks loader workers
def test_the_loader_workers_of_both_contenders_ignore_ctrl_c_which_the_benchmark_alone_takes(image_folder):
    import torch

    from imagenet_elastic.data import sources
    from imagenet_elastic.data.augment import Augment
    from imagenet_elastic.tools import benchmark, throughput

    args = benchmark.build_parser().parse_args([str(image_folder), "--workers", "1", "--batch-size", "8",
                                                "--image-size", "32"])
    train = sources.open_source(sources.train_location(args.data), "train", None)
    augment = Augment(policy=args.auto_augment, erase=args.random_erase)
    feed = throughput.make_feed(args, torch.device("cpu"), 1, augment)
    for make in (throughput.ours_loader(train, feed, args, augment),
                 throughput.textbook_loader(train.root, 32, 8, 1, augment)):
        batches = make(0)
        next(batches)
        (worker,) = batches._workers
        with open(f"/proc/{worker.pid}/status") as status:
            ignored = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))
        del batches

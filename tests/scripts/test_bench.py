"""bench/benchmark.py, the modes that are not installed: one JSON object per mode with the fields the docs promise
(not timings). Its device_ops mode is tests/scripts/test_gpu_checks.py's `device_ops` part."""

from __future__ import annotations

import json
import os
import sys

import benchmark as bench
import inprocess
import pytest
from conftest import REPO, json_lines, run


def bench_args(image_folder, *args: str) -> list[str]:
    return [str(image_folder), "--image-size", "32", "--batch-size", "8", "--workers", "1", *args]


@pytest.mark.slow  # spawns the workers' processes
def test_index_mode_shows_workers_copy_far_less_of_our_index_than_of_a_list_of_tuples(image_folder, warm_python):
    """The benchmark's process is a fork of the warm python; each measurement runs in a new (spawned) one."""
    line, shards = json_lines(run([warm_python, str(REPO / "bench" / "benchmark.py"),
                                   *bench_args(image_folder, "--mode", "index", "--index-entries", "200000")]))
    assert line["entries"] == 200000
    assert 0 < line["ours_worker_private_mb"] <= line["ours_worker_peak_rss_mb"]
    # reading a tuple writes its reference count, so its page is copied; measured 15 MB against 48 MB
    assert 2 * line["ours_worker_private_mb"] < line["list_of_tuples_worker_private_mb"], line
    assert (shards["kind"], shards["entries"], shards["shards"]) == ("tar shards", 200000, 1024)
    assert shards["index_mb"] == round(200000 * 32 / 2**20, 1) and shards["open_seconds"] > 0  # checksums: 4 bytes
    assert line["fingerprint_seconds"] > 0 and shards["fingerprint_seconds"] > 0
    assert 0 < shards["worker_private_mb"] < line["list_of_tuples_worker_private_mb"], shards


def test_checkpoint_mode_compares_a_synchronous_save_and_a_background_save(image_folder, tmp_path):
    (line,) = json_lines(inprocess.command(bench_args(image_folder, "--mode", "checkpoint", "--model", "resnet18",
                                                      "--rounds", "2", "--checkpoints-path", str(tmp_path)),
                                           main=bench.main))
    assert line["mode"] == "checkpoint" and line["model"] == "resnet18" and line["filesystem"] != "unknown"
    assert 80 < line["state_mb"] < 100  # resnet18's weights, momentum and BatchNorm statistics
    assert sorted(line["rounds"]) == ["stall", "sync", "write"]
    for key in ("sync", "stall", "write"):
        assert len(line["rounds"][key]) == 2 and min(line["rounds"][key]) > 0
    assert line["stall_vs_sync"] == pytest.approx(line["stall_seconds"] / line["sync_save_seconds"], rel=0.05, abs=1e-3)
    assert os.listdir(tmp_path) == []  # its temporary folder is gone


@pytest.mark.slow  # forks loader workers
def test_reads_mode_counts_the_files_a_sample_opens_and_a_packs_checksums_cost(image_folder, tmp_path):
    from makers import run_pack

    run_pack(str(image_folder), str(tmp_path / "pack"), "--shard-size", "32")
    folder, pack = (json_lines(inprocess.command(bench_args(data, "--mode", "reads", "--batches", "2", "--rounds",
                                                            "1"), main=bench.main))[0]
                    for data in (image_folder, tmp_path / "pack"))
    assert folder["mode"] == pack["mode"] == "reads" and folder["images_per_sec"] > 0
    assert folder["files_opened_per_sample"] == 1.0  # a class folder's image files, one each
    assert "verified_vs_unverified" not in folder  # no checksums to drop
    assert pack["files_opened_per_sample"] < 0.25  # the 3 shards once each in the worker, not a file per sample
    assert pack["unverified_images_per_sec"] > 0 and sorted(pack["rounds"]) == ["ours", "unverified"]
    assert pack["verified_vs_unverified"] == pytest.approx(
        pack["images_per_sec"] / pack["unverified_images_per_sec"], abs=0.011)


def test_missing_data_folder_is_one_line_where_a_mode_reads_it(tmp_path):
    result = inprocess.command([str(tmp_path / "nope"), "--mode", "device_ops"], main=bench.main)
    assert result.returncode == 2
    assert result.stderr.strip() == f"imagenet-elastic: error: data folder {tmp_path / 'nope'} does not exist"


def test_gpu_decoder_settings_measures_each_setting_alone_and_beside_training_with_its_references(
        image_folder, monkeypatch, capsys):
    """bench/gpu_decoder_settings.py on CPU tensors (nvImageCodec's CPU backend under every setting): a flag or a
    field the script no longer has fails here, not on a GPU."""
    import gpu_decoder_settings as settings

    from imagenet_elastic.data.device import jpeg_decoders

    monkeypatch.setattr(settings, "MODEL", "test_resnet")
    monkeypatch.setattr(settings, "BATCH", 8)
    monkeypatch.setattr(settings, "SIZE", 32)
    monkeypatch.setitem(jpeg_decoders.JPEG_DECODERS, "nvimgcodec", jpeg_decoders.JPEG_DECODERS["nvimgcodec"])
    monkeypatch.setattr(sys, "argv", ["gpu_decoder_settings.py", str(image_folder), "--settings", "product,hw_only",
                                      "--batches", "1", "--few", "1"])
    settings.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    alone = {line["setting"]: line for line in lines if "alone_images_per_sec" in line}
    assert sorted(alone) == ["hw_only", "product"]
    assert all(line["decoded"] == line["of"] == 8 and line["alone_images_per_sec"] > 0 for line in alone.values())
    cases = {line["case"]: line for line in lines if "case" in line}
    many = max(1, (os.cpu_count() or 2) - 2)
    named = ["limit"] + [f"{what}_{n}" for n in dict.fromkeys([many, 1])
                         for what in ("cpu", "torchvision", "product", "hw_only")]
    assert sorted(cases) == sorted(named) and all(line["images_per_sec"] > 0 for line in cases.values())
    assert [cases[f"{what}_1"]["gpu_decoder"] for what in ("cpu", "torchvision", "product", "hw_only")] == [
        None, "torchvision", "nvimgcodec", "nvimgcodec"]
    assert cases["hw_only_1"]["setting"] == "hw_only" and cases["torchvision_1"]["setting"] is None

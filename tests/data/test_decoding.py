"""--decode auto: where a machine's batches are decoded, by the stated rule, and how many loader workers that needs."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_names, single_line

from imagenet_elastic.data import pipeline
from imagenet_elastic.data.augment import Augment
from imagenet_elastic.data.decoding import CPU_DECODE_CORES, GPU_DECODE_WORKERS, Decoding

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
PLAIN, POLICY, ERASING = Augment(), Augment(policy="ta_wide"), Augment(erase=0.1)


@pytest.mark.parametrize("device,cores,augment,mode", [
    (CPU, 2, POLICY, "cpu"),  # no GPU to decode on
    (CUDA, 2, PLAIN, "gpu"),  # an 8-GPU node with few cores per GPU
    (CUDA, CPU_DECODE_CORES - 1, PLAIN, "gpu"),
    (CUDA, CPU_DECODE_CORES, PLAIN, "cpu"),  # cores enough to feed the GPU, nothing else for them to run
    (CUDA, 128, POLICY, "gpu"),  # a policy costs the workers a pass over every image, the device a few operators
    (CUDA, 128, ERASING, "gpu"),
])
def test_auto_decodes_on_the_gpu_unless_the_cpu_has_cores_enough_and_no_policy(device, cores, augment, mode):
    chosen = Decoding.choose("auto", device, cores, augment)
    assert chosen.mode == mode and chosen.why.startswith("auto: ")
    assert f"({chosen.why})" in chosen.describe(device, augment)


@pytest.mark.parametrize("asked", ["cpu", "gpu"])
def test_an_explicit_decode_wins_everywhere(asked):
    for device in (CPU, CUDA):
        for cores, augment in ((1, POLICY), (256, PLAIN)):
            chosen = Decoding.choose(asked, device, cores, augment)
            assert (chosen.mode, chosen.why) == (asked, f"--decode {asked}")


def test_gpu_decoding_defaults_to_few_workers_per_process():
    assert Decoding("gpu").default_workers(64, 1) == GPU_DECODE_WORKERS < pipeline.default_workers(64, 1)
    assert Decoding("gpu").default_workers(3, 1) == pipeline.default_workers(3, 1) == 2  # never more than the cpu's
    assert Decoding("cpu").default_workers(64, 8) == pipeline.default_workers(64, 8)


def test_the_jpeg_librarys_host_threads_are_the_cores_the_loader_workers_and_the_training_thread_leave():
    """nvImageCodec's threads share the process's cores with its loader workers, which feed it: on a node with few
    cores per GPU, a thread for every core but one would starve them."""
    eight = Decoding.choose("gpu", CPU, 8, PLAIN, "nvimgcodec")
    assert [eight.finisher(CPU, print, workers).jpeg.cpu_threads for workers in (0, 4, 6, 7, 12)] == [7, 3, 1, 1, 1]
    assert Decoding.choose("gpu", CPU, 1, PLAIN, "nvimgcodec").finisher(CPU, print, 0).jpeg.cpu_threads == 1
    assert Decoding.choose("cpu", CPU, 8, PLAIN).finisher(CPU, print, 4) is None


def test_a_gpu_decoder_named_where_the_loader_workers_decode_is_said_to_be_unused():
    """--gpu-decoder nvimgcodec where --decode auto picks the workers (no CUDA device, or cores enough) would
    otherwise be dropped without a word; auto's own library choice is nothing to warn about."""
    for asked, device in (("auto", CPU), ("cpu", CUDA)):
        chosen = Decoding.choose(asked, device, 2, PLAIN, "nvimgcodec")
        warning = chosen.warning(device)
        assert warning is not None  # the flag left unused, where the images are decoded instead, and why there
        assert_names(single_line(warning), "--gpu-decoder nvimgcodec", "loader workers", f"({chosen.why})")
    assert Decoding.choose("auto", CPU, 2, PLAIN, "auto").warning(CPU) is None


def test_a_resume_that_decodes_another_way_than_its_checkpoints_run_says_how_to_decode_as_it_did():
    """The ways give pixels up to a level apart; auto's choice depends on the cores per process, which a requeue
    onto another node may change. A checkpoint from before the way was kept (None) says nothing."""
    cpu, gpu = Decoding.choose("cpu", CPU, 2, PLAIN), Decoding.choose("gpu", CPU, 2, PLAIN, "torchvision")
    assert cpu.saved() == {"decode": "cpu"} and gpu.saved() == {"decode": "gpu", "gpu_decoder": "torchvision"}
    assert cpu.change_from(cpu.saved()) is None and gpu.change_from(None) is None
    change = cpu.change_from(gpu.saved())
    assert change is not None  # the checkpoint's way, this run's, and the flags that decode as the checkpoint's did
    assert_names(single_line(change), "decoding", "gpu by torchvision", "cpu", "--decode gpu --gpu-decoder torchvision")
    assert gpu.change_from({"decode": "gpu", "gpu_decoder": "nvimgcodec"}).startswith(
        "decoding: checkpoint gpu by nvimgcodec, now gpu by torchvision (")


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_a_feed_makes_both_loaders_read_and_batch_as_its_mode_says_with_its_workers(mode):
    """The build and `evaluate` ask a Decoding once (`feed`): the workers (--workers, else the mode's default), their
    prefetch, and loaders whose workers read, and batch, as the mode has them."""
    from inprocess import in_memory

    from imagenet_elastic.data import pixels
    from imagenet_elastic.data.device import gpu_decode
    from imagenet_elastic.data.resolution import TrainSizes
    from imagenet_elastic.data.sampler import BatchPlan, TrainBatchSampler

    train, val = in_memory(2, 4, 2)
    decoding = Decoding.choose(mode, CPU, 8, PLAIN)
    feed = decoding.feed(CPU, None, 4, 2, 8, 64, print)
    assert (feed.workers, feed.pinned) == (decoding.default_workers(4, 2), False)
    assert feed.workers == (min(GPU_DECODE_WORKERS, pipeline.default_workers(4, 2)) if mode == "gpu"
                            else pipeline.default_workers(4, 2))
    assert (feed.decoder is None) == (mode == "cpu")
    assert decoding.feed(CPU, 0, 4, 2, 8, 64, print).workers == 0  # --workers wins
    sampler = TrainBatchSampler(len(train), BatchPlan(4, 1, 4), 0, 0)
    loaders = (feed.train_loader(train, TrainSizes(32), 0, PLAIN, sampler),
               feed.eval_loader(val, 32, 37, 4, 0, 1))
    reads = (gpu_decode.encode_bytes, gpu_decode.encode_centre_crop) if mode == "gpu" else (
        pixels.decode_bytes, pixels.decode_centre_crop)
    assert tuple(loader.dataset.load for loader in loaders) == reads
    collate = gpu_decode.collate if mode == "gpu" else pipeline.collate
    assert all(loader.collate_fn is collate and loader.num_workers == feed.workers for loader in loaders)

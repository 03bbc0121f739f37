"""Never lose work: real torchrun, real signals, real files; every result compared with an uninterrupted run."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import fault_injection as fi
import inprocess
import pytest
from conftest import (
    AUGMENTED,
    EPOCHS,
    MIXED,
    REPO,
    SMALL_RUN,
    TRAIN_IMAGES,
    assert_names,
    assert_same_tensors,
    child_env,
    finish,
    load_checkpoint,
    make_image_folder,
    python_cmd,
    restart_cost,
    run,
    run_and_kill,
    start,
    torchrun_cmd,
    torchrun_worker,
    torchrun_workers,
)

from imagenet_elastic.errors import PREEMPTED_EXIT
from imagenet_elastic.report.metrics import read as read_metrics
from imagenet_elastic.report.samplelog import ENV_VAR, coverage

pytestmark = [pytest.mark.slow,  # every test here starts processes
              pytest.mark.usefixtures("warm_ranks")]  # the ranks torchrun starts: forks of the warm python

GLOBAL_BATCH = 16  # SMALL_RUN's 8 per process x 2
SAMPLES_PER_EPOCH = TRAIN_IMAGES // GLOBAL_BATCH * GLOBAL_BATCH


def assert_same_as_reference(ckpt, reference) -> None:
    killed, clean = load_checkpoint(ckpt / "last.pt"), load_checkpoint(reference / "last.pt")
    assert_same_tensors(killed["model"], clean["model"])
    assert_same_tensors(killed["optimizer"]["state"], clean["optimizer"]["state"])
    assert (killed["epoch"], killed["step"]) == (clean["epoch"], clean["step"])


def assert_every_sample_once(log_dir, epochs: int = EPOCHS, global_batch: int = GLOBAL_BATCH):
    report = coverage(str(log_dir), TRAIN_IMAGES // global_batch * global_batch, global_batch)
    assert report.epochs == epochs
    assert (report.samples_lost, report.samples_repeated) == (0, 0), report
    return report


# The recipe options whose randomness is drawn per sample or per step, all on, and FFCV's BlurPool; the ramp's
# larger size from epoch 2
RECIPE = [*AUGMENTED, *MIXED, "--progressive-resize", "32,64", "--progressive-epochs", "0,1", "--model-ema",
          "--model-ema-decay", "0.9", "--model-ema-steps", "2", "--blurpool"]


@pytest.fixture(scope="module")
def recipe_reference(image_folder, tmp_path_factory) -> Path:
    """torchrun_reference with RECIPE on."""
    ckpt = tmp_path_factory.mktemp("recipe_reference")
    result = run(torchrun_cmd(2, str(image_folder), *SMALL_RUN, *RECIPE, "--epochs", str(EPOCHS),
                              "--checkpoints-path", str(ckpt)))
    assert result.returncode == 0, result.stdout + result.stderr
    return ckpt


KILL_SEED = "KILL_SEED"  # set it to a seed a run printed to kill at the same place again


def kill_seed() -> int:
    """A new draw each run, so that over many CI runs every (epoch, step, rank) is met; printed for a replay."""
    return int(os.environ.get(KILL_SEED) or random.SystemRandom().randrange(1 << 32))


# One kill, with every option on: the runs without them are the SIGTERM test's (a second kill cost CI 30 s it
# does not have).
@pytest.mark.multiprocess
def test_sigkill_of_a_random_worker_at_a_random_step_resumes_bitwise(image_folder, tmp_path, recipe_reference):
    """torchrun restarts the round; it continues from the step checkpoint, mid-epoch, with the next samples.
    With every recipe option that draws per sample or per step on, and a progressive ramp: the raw weights and
    their average end bitwise those of an uninterrupted run, whichever rank dies (rank 0 writes the
    checkpoints, in the background) and wherever."""
    seed = kill_seed()
    rng = random.Random(seed)
    epoch, step, rank = rng.randint(1, EPOCHS), rng.randint(1, 5), rng.randint(0, 1)
    replay = f"SIGKILL of rank {rank} in epoch {epoch} step {step}; replay with {KILL_SEED}={seed}"
    print(replay)  # shown with a failure's captured output
    reference = recipe_reference
    cmd = torchrun_cmd(2, str(image_folder), *SMALL_RUN, *RECIPE, "--epochs", str(EPOCHS),
                       "--checkpoint-interval", "1", "--checkpoints-path", str(tmp_path / "ckpt"), restarts=1)
    code, output = run_and_kill(cmd, when=f"epoch {epoch}/{EPOCHS} step {step}/", victim=torchrun_worker(rank),
                                env=child_env(**{ENV_VAR: str(tmp_path / "samples")}))
    assert code == 0, f"{replay}\n{output}"
    # Killed after step k's log line, the run has step k-1's checkpoint at least (k = 1: the previous epoch's end)
    resumed = re.search(r"resuming from .*last\.pt: \d epochs? done(, \d+ samples into epoch \d)?", output)
    if (epoch, step) == (1, 1):  # the first step's checkpoint may still have been in the writer's hands
        assert resumed or "no checkpoint at" in output, f"{replay}\n{output}"
    else:
        assert resumed, f"{replay}\n{output}"
    if resumed:  # the restart line: each part of the restart (restart_cost: they add up), in a process started after
        line, cost = restart_cost(output)  # the checkpoint was written, eager: no compile nor its cache
        assert cost.keys() == {"whole", "process started", "imports", "build steps", "checkpoint load",
                               "first step"}, f"{replay}\n{line}"
        assert all(0 <= seconds <= cost["whole"] + 0.1 for seconds in cost.values()), f"{replay}\n{line}"
    assert_same_as_reference(tmp_path / "ckpt", reference)
    assert_same_tensors(load_checkpoint(tmp_path / "ckpt" / "last.pt")["model_ema"],
                        load_checkpoint(reference / "last.pt")["model_ema"])
    assert assert_every_sample_once(tmp_path / "samples").steps_redone <= 2
    rows, clean_rows = read_metrics(tmp_path / "ckpt" / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    exact = ("epoch", "val_loss", "val_top1", "val_top5", "val_samples", "lr", "world_size", "global_batch")
    assert [[r[k] for k in exact] for r in rows] == [[r[k] for k in exact] for r in clean_rows]
    # the epoch's mean loss is summed (in float64) in pieces across the restart: equal up to rounding
    assert [r["train_loss"] for r in rows] == pytest.approx([r["train_loss"] for r in clean_rows], rel=1e-12)


@pytest.mark.multiprocess
def test_sigterm_to_every_worker_checkpoints_within_one_step_exits_75_and_resume_is_exact(
        image_folder, tmp_path, torchrun_reference):
    reference, _ = torchrun_reference
    env = child_env(**{ENV_VAR: str(tmp_path / "samples")})
    args = [str(image_folder), *SMALL_RUN, "--epochs", str(EPOCHS), "--checkpoints-path", str(tmp_path / "ckpt")]
    code, output = run_and_kill(torchrun_cmd(2, *args), when=f"epoch 2/{EPOCHS} step 3/", victim=torchrun_workers,
                                sig=signal.SIGTERM, env=env)
    assert code != 0, output
    # torchrun's summary lists the workers that exited on their own (the later one may be stopped by torchrun)
    codes = re.findall(r"exitcode\s*: (-?\d+)", output)
    assert codes and set(codes) == {str(PREEMPTED_EXIT)}, output
    came, stopped = map(int, re.search(r"SIGTERM came after step (\d+); stopped after step (\d+)", output).groups())
    assert stopped - came <= 1, "the stop must come at the next step boundary"
    snapshot = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert snapshot["step"] == stopped and snapshot["epoch"] == 1
    assert snapshot["epoch_progress"]["samples"] == (stopped - 6) * GLOBAL_BATCH  # 6 steps per epoch
    resumed = subprocess.run(torchrun_cmd(2, *args, "--resume"), cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_as_reference(tmp_path / "ckpt", reference)
    assert assert_every_sample_once(tmp_path / "samples").steps_redone == 0  # nothing trained twice


@pytest.mark.multiprocess
def test_sigusr1_to_a_single_process_checkpoints_and_exits_75(image_folder, tmp_path, warm_python):
    """The runs are forks of the warm python: the signal reaches the trainer through its caller."""
    args = [str(image_folder), *SMALL_RUN, "--epochs", "2", "--threads", "1", "--checkpoints-path"]  # 2 runs, 2 cores
    clean = start(python_cmd(*args, str(tmp_path / "clean"), python=warm_python))
    code, output = run_and_kill(python_cmd(*args, str(tmp_path / "ckpt"), python=warm_python),
                                when="epoch 1/2 step 4/", victim=lambda proc: proc.pid, sig=signal.SIGUSR1)
    assert finish(clean).returncode == 0
    assert code == PREEMPTED_EXIT, output
    assert "Traceback" not in output and f"exiting with code {PREEMPTED_EXIT}" in output
    resumed = run(python_cmd(*args, str(tmp_path / "ckpt"), "--resume", python=warm_python))
    assert resumed.returncode == 0, resumed.stderr
    assert "samples into epoch 1" in resumed.stdout
    assert_same_tensors(load_checkpoint(tmp_path / "ckpt" / "last.pt")["model"],
                        load_checkpoint(tmp_path / "clean" / "last.pt")["model"])


@pytest.fixture(scope="module")
def mid_epoch_checkpoint_world2(image_folder, tmp_path_factory):
    """A world-size-2 run with a global batch of 24, stopped by SIGTERM after step 1 of epoch 1's 4 steps
    (with batches decoded ahead, a later trigger can lose the race to the epoch's end)."""
    folder = tmp_path_factory.mktemp("world2")
    env = child_env(**{ENV_VAR: str(folder / "samples")})
    cmd = torchrun_cmd(2, str(image_folder), *SMALL_RUN, "--epochs", "2", "--global-batch-size", "24",
                       "--checkpoints-path", str(folder / "ckpt"))
    code, output = run_and_kill(cmd, when="epoch 1/2 step 1/", victim=torchrun_workers, sig=signal.SIGTERM, env=env)
    assert f"exitcode  : {PREEMPTED_EXIT}" in output, output
    snapshot = load_checkpoint(folder / "ckpt" / "last.pt")
    assert snapshot["epoch"] == 0 and 0 < snapshot["epoch_progress"]["samples"] < 96
    return folder


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.multiprocess
def test_checkpoint_of_world_size_2_resumes_at_another_world_size_with_the_same_global_batch(
        image_folder, tmp_path, mid_epoch_checkpoint_world2, world_size, monkeypatch):
    shutil.copytree(mid_epoch_checkpoint_world2, tmp_path, dirs_exist_ok=True)
    args = [str(image_folder), *SMALL_RUN, "--epochs", "2", "--checkpoints-path", str(tmp_path / "ckpt"), "--resume"]
    if world_size == 1:  # one rank: in this process
        monkeypatch.setenv(ENV_VAR, str(tmp_path / "samples"))
        result = inprocess.command([*args, "--workers", "0"])
    else:
        result = subprocess.run(torchrun_cmd(world_size, *args), cwd=REPO,
                                env=child_env(**{ENV_VAR: str(tmp_path / "samples")}), capture_output=True, text=True,
                                timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    split = {1: "24 = 1 process x 24, in 3 micro-batches of 8", 3: "24 = 3 processes x 8"}[world_size]
    assert split in result.stdout
    said = [line for line in result.stderr.splitlines() if "micro-batches:" in line]
    assert len(said) == 1, result.stderr  # once: the checkpoint's split of the global batch, then this run's
    assert_names(said[0], "24 = 2 processes x 12", "2 micro-batches of 6", split)
    final = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert final["global_batch"] == 24 and final["world_size"] == world_size and final["step"] == 2 * 4
    report = assert_every_sample_once(tmp_path / "samples", epochs=2, global_batch=24)
    assert report.world_sizes == (2, world_size)


@pytest.mark.multiprocess
def test_global_batch_that_does_not_split_over_the_new_world_size_is_refused_at_start(
        image_folder, tmp_path, mid_epoch_checkpoint_world2):
    """The checkpoint's global batch is 24; 5 processes cannot share it evenly. Rank 0 of 5, started with the
    variables a launcher sets, is enough: the refusal comes before any rank waits for the others."""
    shutil.copytree(mid_epoch_checkpoint_world2 / "ckpt", tmp_path / "ckpt")
    env = child_env(RANK="0", WORLD_SIZE="5", LOCAL_RANK="0", LOCAL_WORLD_SIZE="5", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(fi.free_port()))
    result = subprocess.run(python_cmd(str(image_folder), *SMALL_RUN, "--checkpoints-path", str(tmp_path / "ckpt"),
                                       "--resume", "--epochs", "2"), cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("imagenet-elastic: error: "), result.stderr
    assert_names(errors[0], "24", "5", "--global-batch-size")  # the global batch, the world size, the flag to pass
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_second_run_on_a_checkpoints_path_in_use_is_refused_and_the_first_is_unharmed(image_folder, tmp_path,
                                                                                       warm_python):
    """The lock, not timing luck: the second run starts while the first is training, waits 2 s, gives up. The first
    is a new interpreter (the lock names its pid), the second a fork of the warm python."""
    args = [str(image_folder), *SMALL_RUN, "--epochs", "50", "--checkpoints-path", str(tmp_path), "--resume",
            "--dist-timeout", "2"]
    first = fi.Agent(python_cmd(*args), child_env())
    try:
        first.wait_for(r"epoch 1/50 step 2/", 120)
        second = run(python_cmd(*args, python=warm_python))
        assert second.returncode == 2, second.stdout + second.stderr
        said = second.stderr.strip().splitlines()
        assert said[-1].startswith("imagenet-elastic: error: ")  # the folder, its holder (pid, host), the flag
        assert_names(said[-1], tmp_path, f"pid {first.proc.pid}", socket.gethostname(), "--checkpoints-path")
        assert len(said) == 2 and "is locked by" in said[0]  # it said it was waiting
        os.kill(first.proc.pid, signal.SIGTERM)  # the first run was never disturbed: it stops cleanly
        assert first.wait(120) == PREEMPTED_EXIT, first.output
    finally:
        first.kill_node()
    stopped = int(re.search(r"stopped after step (\d+)", first.output).group(1))
    assert load_checkpoint(tmp_path / "last.pt")["step"] == stopped >= 2  # the first run's own last word


@pytest.fixture(scope="module")
def elastic_job(tmp_path_factory) -> fi.Job:
    """384 images: 24 steps per epoch, long enough for a node to join while one worker trains alone. With
    every per-sample augmentation option, the per-step mixing and drop-path, a progressive size and the weight
    average on: they claim world-size invariance."""
    workdir = tmp_path_factory.mktemp("elastic")
    data = make_image_folder(workdir / "data", classes=8, train_per_class=48, val_per_class=4)
    args = (*SMALL_RUN, *AUGMENTED, *MIXED, "--progressive-resize", "32,64", "--progressive-epochs", "1,2",
            "--model-ema", "--model-ema-decay", "0.9", "--epochs", str(EPOCHS))
    return fi.Job(str(data), args, 384, GLOBAL_BATCH, workdir)


@pytest.mark.multiprocess
@pytest.mark.mostly_waiting  # for the rendezvous to re-form, twice
def test_node_lost_then_node_joined_keeps_the_global_batch_and_every_sample_once(elastic_job):
    """Two c10d agents (one worker each); one is SIGKILLed with its worker in epoch 1, the survivor goes
    on alone at the same global batch (2 micro-batches of 8), then a new agent joins and the job is 2 again.

    Tolerance: a step's gradient is (g0 + g1) / 2 from DDP at world size 2 and g0 / 2 + g1 / 2 from
    accumulation at world size 1; halving is exact in binary floating point, so the two agree to the
    last bit here. Other world sizes sum in another order and differ in the last bits of each step,
    which training then amplifies, hence the bound of 1e-5 rather than equality.
    """
    clean_wall = fi.run_clean(elastic_job)
    outcome, outputs = fi.elastic(elastic_job, kill_at=(1, 8), epochs=EPOCHS, clean_wall=clean_wall, timeout=180)
    assert outcome.world_sizes == (2, 1, 2), outputs
    assert (outcome.samples_lost, outcome.samples_repeated) == (0, 0)
    assert "16 = 1 process x 16, in 2 micro-batches of 8" in outputs  # the same global batch when alone
    assert outputs.count("16 = 2 processes x 8") == 2  # at the start and after the join
    assert "results will not match" not in outputs  # the same micro-batches of 8 at both world sizes
    assert all(0 < seconds < 60 for seconds in outcome.recovery_s), outcome.recovery_s
    assert fi.compare_weights(elastic_job.last("elastic"), elastic_job.last("clean")) <= 1e-5
    assert fi.compare_weights(elastic_job.last("elastic"), elastic_job.last("clean"), "model_ema") <= 1e-5


@pytest.mark.multiprocess
def test_spawn_parent_passes_sigusr1_to_its_ranks_and_exits_75(image_folder, tmp_path, torchrun_reference,
                                                              warm_python):
    """Slurm's one-task-per-node layout: the signal reaches the task (the spawning parent), not only the ranks.
    The parent is a fork of the warm python (the signal reaches it through its caller); the ranks, new interpreters
    (spawn)."""
    reference, _ = torchrun_reference
    args = [str(image_folder), *SMALL_RUN, "--epochs", str(EPOCHS), "--checkpoints-path", str(tmp_path),
            "--dist-init-method", "spawn", "--nproc-per-node", "2"]
    code, output = run_and_kill(python_cmd(*args, python=warm_python), when=f"epoch 2/{EPOCHS} step 2/",
                                victim=lambda proc: proc.pid, sig=signal.SIGUSR1)
    assert code == PREEMPTED_EXIT, output
    assert "error" not in output.lower(), output
    resumed = run(python_cmd(*args, "--resume", python=warm_python))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "samples into epoch 2" in resumed.stdout
    assert_same_as_reference(tmp_path, reference)


def test_time_based_checkpoint_interval_saves_mid_epoch(image_folder, tmp_path, warm_python):
    """`--checkpoint-interval 0.001s` is due at every step: a SIGKILL mid-epoch loses at most the step in flight and
    the one whose background write was in flight (step 3's save waited for step 2's write, and step 4's line came
    after it; step 3's own write may still be going when the kill comes)."""
    args = [str(image_folder), *SMALL_RUN, "--epochs", "2", "--checkpoint-interval", "0.001s",
            "--checkpoints-path", str(tmp_path)]
    code, output = run_and_kill(python_cmd(*args, python=warm_python), when="epoch 2/2 step 4/",
                                victim=lambda proc: proc.pid)
    assert code == -signal.SIGKILL, output
    snapshot = load_checkpoint(tmp_path / "last.pt")
    assert snapshot["epoch"] == 1 and snapshot["epoch_progress"]["samples"] >= 2 * 8
    assert "every 0.001 s" in output  # said in the start-up table


@pytest.mark.multiprocess
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint(image_folder, tmp_path):
    """Only rank 1 gets SIGUSR1 (a node's scheduler warned it alone): the stop is agreed at the next step
    boundary, rank 0 writes the checkpoint of that step, and both ranks exit 75."""
    args = [str(image_folder), *SMALL_RUN, "--epochs", str(EPOCHS), "--checkpoints-path", str(tmp_path / "ckpt")]
    code, output = run_and_kill(torchrun_cmd(2, *args), when=f"epoch 1/{EPOCHS} step 3/", victim=torchrun_worker(1),
                                sig=signal.SIGUSR1)
    assert code != 0, output
    codes = re.findall(r"exitcode\s*: (-?\d+)", output)
    assert codes and set(codes) == {str(PREEMPTED_EXIT)}, output
    stopped = int(re.search(r"a preemption signal came to another rank; stopped after step (\d+)", output).group(1))
    # when rank 1 saw it depends on how far it ran while the test found its pid (a step here takes ~10 ms)
    assert 3 <= stopped < EPOCHS * 6, output
    snapshot = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert snapshot["step"] == stopped  # rank 0 checkpointed the very step both ranks stopped after
    assert snapshot["epoch_progress"]["samples"] == (stopped - 6 * snapshot["epoch"]) * GLOBAL_BATCH
    assert not re.search(r'File ".*imagenet_elastic/', output), output  # torchrun's own summary only

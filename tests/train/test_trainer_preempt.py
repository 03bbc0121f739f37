"""A preemption signal before training began (launch/preemption.py): the rank stops at once, exit 75, one line,
rank 0 requeues as the stop at a step does; a peer's stop met first in a start-up collective is the same stop."""

from __future__ import annotations

import os
import re
import signal
import time

import inprocess
import pytest
from conftest import SMALL_RUN, assert_names

from imagenet_elastic.checkpoint import saving
from imagenet_elastic.errors import PREEMPTED_EXIT
from imagenet_elastic.launch import preemption
from imagenet_elastic.train import trainer as trainer_module

PEER_GONE = "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"  # gloo's words


def args(image_folder, folder, *extra: str) -> list[str]:
    return [str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1", "--max-steps-per-epoch", "2",
            "--checkpoints-path", str(folder), *extra]


def stop_line(output: str) -> str:
    said = [line for line in output.splitlines() if "before training began" in line]
    assert len(said) == 1, output
    return said[0]


def assert_nothing_written(folder) -> None:
    """No checkpoint, no temp file a later start could meet: start-up writes none."""
    assert not [name for name in os.listdir(folder) if name.endswith(".pt") or name.startswith(".tmp-")]


@pytest.fixture
def requeued(monkeypatch) -> list[str]:
    """The jobs `scontrol requeue` was asked for, in a Slurm job's environment."""
    jobs: list[str] = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(preemption, "requeue_slurm_job", lambda job: jobs.append(job) or "")
    return jobs


@pytest.mark.parametrize("sent,requeues", [(signal.SIGUSR1, True), (signal.SIGTERM, False)], ids=["USR1", "TERM"])
def test_a_signal_during_start_up_stops_at_once_with_exit_75_one_line_and_usr1_requeues(image_folder, tmp_path,
                                                                                         monkeypatch, requeued, sent,
                                                                                         requeues):
    """SIGTERM is not requeued: a launcher sends it to the other ranks after one failed (trainer.stopped_at_once)."""
    def signalled(*_args, **_kwargs):  # the scheduler's signal comes while the run builds (a compile, a scan, ...)
        os.kill(os.getpid(), sent)
        time.sleep(5)
        raise AssertionError("the signal did not stop the start-up at once")
    monkeypatch.setattr(trainer_module, "fit_micro_batches", signalled)
    done = inprocess.command(args(image_folder, tmp_path, "--requeue-on-preempt"))
    assert done.returncode == PREEMPTED_EXIT and "Traceback" not in done.stderr, done.stderr
    assert_names(stop_line(done.stdout), sent.name, "nothing trained", "no checkpoint", PREEMPTED_EXIT)
    assert requeued == (["4242"] if requeues else [])
    assert_nothing_written(tmp_path)


def test_a_signal_in_the_first_step_stops_at_once_and_keeps_the_checkpoint_as_it_was(image_folder, tmp_path,
                                                                                      monkeypatch, requeued):
    """The first step of a process compiles (minutes on a GPU, beyond a scheduler's grace period) and trains nothing
    a checkpoint lacks until it ends: a signal in it stops at once, as one during start-up does."""
    assert inprocess.command(args(image_folder, tmp_path)).returncode == 0
    saved = (tmp_path / "last.pt").read_bytes()

    def signalled(*_args, **_kwargs):  # the scheduler's signal comes while the step compiles
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)
        raise AssertionError("the signal did not stop the first step at once")
    monkeypatch.setattr(trainer_module, "train_step", signalled)
    done = inprocess.command(args(image_folder, tmp_path, "--epochs", "2", "--resume", "--requeue-on-preempt"))
    assert done.returncode == PREEMPTED_EXIT and "Traceback" not in done.stderr, done.stderr
    assert_names(stop_line(done.stdout), "SIGUSR1", "nothing trained", "no checkpoint", PREEMPTED_EXIT)
    assert requeued == ["4242"]
    assert (tmp_path / "last.pt").read_bytes() == saved


def failing_start_up(received, message: str):
    """A build step that fails as a start-up collective does, on a rank whose flag holds `received`: the handler
    only recorded the signal, had it come while the rank already unwound (its C++ wait returned with the error)."""
    def step(run, *_args, **_kwargs):
        run.preempt.received = received
        raise RuntimeError(message)
    return step


def test_a_vanished_peer_in_start_up_on_a_signalled_rank_is_the_same_stop(image_folder, tmp_path, monkeypatch,
                                                                          requeued):
    monkeypatch.setattr(trainer_module, "fit_micro_batches", failing_start_up("SIGUSR1", PEER_GONE))
    done = inprocess.command(args(image_folder, tmp_path, "--requeue-on-preempt"))
    assert done.returncode == PREEMPTED_EXIT and "Traceback" not in done.stderr, done.stderr
    assert_names(stop_line(done.stdout), "SIGUSR1")
    assert requeued == ["4242"]


@pytest.mark.parametrize("step", [1, 2])
def test_a_peer_gone_at_the_first_steps_end_on_a_signalled_rank_is_the_same_stop_and_later_a_crash(
        image_folder, tmp_path, monkeypatch, step):
    """The peer took the signal in its first step and stopped at once; this rank took it just after its own, which
    only raised the flag, and meets the peer's absence in the step's agreement: the same stop. Past the first step's
    agreement every rank's stop is the agreed one: a peer gone there crashed."""
    def peer_gone(_checkpointer, at: int, _stop_requested: bool) -> tuple[bool, bool]:
        if at < step:
            return False, False
        os.kill(os.getpid(), signal.SIGUSR1)
        raise RuntimeError(PEER_GONE)
    monkeypatch.setattr(saving.Checkpointer, "at_step_end", peer_gone)
    if step > 1:
        with pytest.raises(RuntimeError, match=re.escape(PEER_GONE)):
            inprocess.command(args(image_folder, tmp_path))
        return
    done = inprocess.command(args(image_folder, tmp_path))
    assert done.returncode == PREEMPTED_EXIT and "Traceback" not in done.stderr, done.stderr
    assert_names(stop_line(done.stdout), "SIGUSR1")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("received,message", [(None, PEER_GONE), ("SIGTERM", "an unrelated bug")])
def test_a_vanished_peer_without_a_signal_or_another_error_with_one_stays_a_crash(image_folder, tmp_path,
                                                                                  monkeypatch, received, message):
    monkeypatch.setattr(trainer_module, "fit_micro_batches", failing_start_up(received, message))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        inprocess.command(args(image_folder, tmp_path))


def test_a_failed_requeue_says_one_line_on_stderr_and_still_exits_75(image_folder, tmp_path, monkeypatch):
    """It printed scontrol's four lines to stdout; the checkpoint is written, so the exit stays 75."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\nfor n in 1 2 3 4; do echo \"scontrol: error $n: Requeue disabled\" >&2; done\n"
                        "exit 1\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")

    def signalled(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)
    monkeypatch.setattr(trainer_module, "fit_micro_batches", signalled)
    done = inprocess.command(args(image_folder, tmp_path / "ck", "--requeue-on-preempt"))
    assert done.returncode == PREEMPTED_EXIT, done.stderr
    assert "scontrol: error" not in done.stdout
    said = [line for line in done.stderr.splitlines() if "scontrol" in line]
    assert len(said) == 1, done.stderr
    assert_names(said[0], "scontrol requeue 4242", "error 1")
    assert_names(stop_line(done.stdout), "SIGUSR1", PREEMPTED_EXIT)

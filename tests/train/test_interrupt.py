"""Ctrl-C (launch/preemption.py): while the run trains, the first is a stop with a checkpoint at the step, exit 130; a
second stops at once and says which checkpoint was kept and how many steps were lost; one before training stops at
once and says nothing was trained. In this process where the signal's handler can be called by hand, as a process
where only a real Ctrl-C to the process group shows it (its loader workers live on for the checkpoint)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import inprocess
import pytest
from conftest import REPO, SMALL_RUN, assert_names, child_env, load_checkpoint, python_cmd, run, run_and_kill

from imagenet_elastic.checkpoint import store
from imagenet_elastic.errors import INTERRUPTED_EXIT
from imagenet_elastic.train import trainer as trainer_module
from imagenet_elastic.train.trainer import Trainer


def ctrl_c_at_step(step: int, times: int):
    """A before_fit hook: `times` Ctrl-Cs come at the end of `step`, as the handler takes them."""
    def hook(trainer: Trainer) -> None:
        at_step_end = trainer.checkpointer.at_step_end

        def with_interrupts(at: int, stop_requested: bool) -> tuple[bool, bool]:
            if at == step:
                for _ in range(times):
                    trainer.preempt._interrupt(signal.SIGINT, None)  # the second raises, as a handler's would
            return at_step_end(at, stop_requested or trainer.preempt.received is not None)
        trainer.checkpointer.at_step_end = with_interrupts  # type: ignore[method-assign]
    return hook


def ctrl_c_line(output: str) -> str:
    """The one line the run answers a Ctrl-C with (the start-up table's row of what Ctrl-C does aside)."""
    said = [line for line in output.splitlines() if line.startswith("Ctrl-C")]
    assert len(said) == 1, output
    return said[0]


def args(image_folder, folder, *extra: str) -> list[str]:
    return [str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1", "--max-steps-per-epoch", "6",
            "--checkpoints-path", str(folder), *extra]


def test_a_first_ctrl_c_while_training_stops_at_the_step_with_a_checkpoint_and_exit_130(image_folder, tmp_path,
                                                                                        capsys):
    outcome = inprocess.train(args(image_folder, tmp_path), before_fit=ctrl_c_at_step(3, times=1))
    assert outcome.stopped and outcome.final_step == 3 and outcome.saved_at_steps == [3]
    # when it came, where the run stopped, the checkpoint it wrote, the exit code
    assert_names(ctrl_c_line(capsys.readouterr().out), "step 3", "step 3", tmp_path / "last.pt", INTERRUPTED_EXIT)
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 3


def test_a_second_ctrl_c_stops_at_once_naming_the_checkpoint_kept_and_the_steps_lost(image_folder, tmp_path, capsys):
    with pytest.raises(KeyboardInterrupt):
        inprocess.train(args(image_folder, tmp_path, "--checkpoint-interval", "2"),
                        before_fit=ctrl_c_at_step(3, times=2))
    # at once, after which step; the checkpoint kept and where it stands; the steps lost; the flag that continues
    assert_names(ctrl_c_line(capsys.readouterr().out), "at once", "step 3", tmp_path / "last.pt", "step 2",
                 "16 samples", "epoch 1", "1 step", "--resume")
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 2  # as it was: the step-2 checkpoint, whole


def ctrl_c_during_the_write(monkeypatch, times: int) -> threading.Event:
    """The first checkpoint write, held at its start, sends the training thread `times` Ctrl-Cs 0.3 s apart, then
    writes once the Event returned is set (by the test, or 0.3 s on with a single Ctrl-C)."""
    release, save_to = threading.Event(), store.save_to

    def held(state, file) -> None:  # type: ignore[no-untyped-def]
        for _ in range(times):
            time.sleep(0.3)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        release.wait(0.3 if times == 1 else 30)
        save_to(state, file)

    monkeypatch.setattr(store, "save_to", held)
    return release


def test_a_second_ctrl_c_during_the_stops_write_waits_for_it_and_names_it_kept(image_folder, tmp_path, capsys,
                                                                                monkeypatch):
    ctrl_c_during_the_write(monkeypatch, times=1)
    with pytest.raises(KeyboardInterrupt):
        inprocess.train(args(image_folder, tmp_path), before_fit=ctrl_c_at_step(3, times=1))
    said = capsys.readouterr().out
    assert "waiting for the checkpoint write" in said
    assert_names(ctrl_c_line(said), "at once", "step 3", tmp_path / "last.pt", "step 3", "nothing lost", "--resume")
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 3


def test_a_third_ctrl_c_abandons_the_write_in_flight_and_says_so(image_folder, tmp_path, capsys, monkeypatch):
    release = ctrl_c_during_the_write(monkeypatch, times=2)
    try:
        with pytest.raises(KeyboardInterrupt):
            inprocess.train(args(image_folder, tmp_path), before_fit=ctrl_c_at_step(3, times=1))
        assert_names(ctrl_c_line(capsys.readouterr().out), "at once", "step 3", "first checkpoint", "abandoning",
                     "3 steps")
        assert not (tmp_path / "last.pt").exists()
    finally:
        release.set()


GLOO_PEER_GONE = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6872"


def peer_stops_at_once_at_step(step: int, ctrl_c: bool):
    """A before_fit hook: at the end of `step` (after a first Ctrl-C there, if `ctrl_c`), the agreement's collective
    fails as gloo's does when another rank has exited: that rank took the second Ctrl-C before this one did."""
    def hook(trainer: Trainer) -> None:
        def peer_gone(at: int, _stop_requested: bool) -> tuple[bool, bool]:
            if at == step:
                if ctrl_c:
                    trainer.preempt._interrupt(signal.SIGINT, None)
                raise RuntimeError(GLOO_PEER_GONE)
            return False, False
        trainer.checkpointer.at_step_end = peer_gone  # type: ignore[method-assign]
    return hook


@pytest.mark.parametrize("ctrl_c", [True, False])
def test_a_peer_gone_from_a_collective_after_a_ctrl_c_is_the_stop_at_once_and_a_crash_otherwise(
        image_folder, tmp_path, capsys, ctrl_c):
    with pytest.raises(KeyboardInterrupt if ctrl_c else RuntimeError):
        inprocess.train(args(image_folder, tmp_path), before_fit=peer_stops_at_once_at_step(2, ctrl_c))
    said = capsys.readouterr().out
    if ctrl_c:  # at once, after step 2, with no checkpoint to name
        assert_names(ctrl_c_line(said), "at once", "step 2", "first checkpoint")
    else:  # a crash: no Ctrl-C line
        assert not [line for line in said.splitlines() if line.startswith("Ctrl-C")], said


def test_a_second_ctrl_c_before_the_first_checkpoint_says_every_step_is_lost(image_folder, tmp_path, capsys):
    with pytest.raises(KeyboardInterrupt):
        inprocess.train(args(image_folder, tmp_path), before_fit=ctrl_c_at_step(2, times=2))
    assert_names(ctrl_c_line(capsys.readouterr().out), "at once", "step 2", "first checkpoint", "2 steps")
    assert not (tmp_path / "last.pt").exists()


def test_ctrl_c_during_start_up_exits_130_saying_nothing_was_trained(image_folder, tmp_path, monkeypatch):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer_module, "fit_micro_batches", interrupted)
    done = inprocess.command(args(image_folder, tmp_path))
    assert done.returncode == INTERRUPTED_EXIT and "Traceback" not in done.stderr
    assert_names(ctrl_c_line(done.stdout), "before training", "nothing trained", "no checkpoint")
    assert not (tmp_path / "last.pt").exists()


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_checkpoints_at_the_step_exits_130_and_resumes(image_folder, tmp_path):
    """As a terminal sends it: to the run and its loader worker alike. The worker lives on for the checkpoint."""
    argv = [str(image_folder), *SMALL_RUN, "--epochs", "2", "--threads", "1", "--checkpoints-path", str(tmp_path)]
    code, output = run_and_kill(python_cmd(*argv), when="epoch 1/2 step 3/", victim=lambda proc: -proc.pid,
                                sig=signal.SIGINT)
    assert code == INTERRUPTED_EXIT, output
    assert "Ctrl-C again stops at once" in output and "Traceback" not in output and "DataLoader" not in output
    came, stopped = map(int, re.search(r"Ctrl-C came after step (\d+); stopped after step (\d+) with a checkpoint in "
                                       rf"{re.escape(str(tmp_path / 'last.pt'))}; exiting with code 130",
                                       output).groups())
    assert stopped in (came, came + 1) and load_checkpoint(tmp_path / "last.pt")["step"] == stopped
    resumed = run(python_cmd(*argv, "--resume"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "samples into epoch 1" in resumed.stdout and load_checkpoint(tmp_path / "last.pt")["epoch"] == 2


def press_ctrl_c(cmd: list[str], after: list[str], timeout: float = 240) -> tuple[int, str]:
    """Run `cmd` in a process group of its own and send the group a SIGINT, as a terminal's Ctrl-C, once a line holds
    each of `after` in turn. Returns the exit code and the output (stdout and stderr)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if after and after[0] in line:
                os.killpg(proc.pid, signal.SIGINT)
                lines.append(f"<<< test: Ctrl-C after {after.pop(0)!r} >>>\n")
        code = proc.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group (nothing, when all went well)
    assert not after, f"{after[0]!r} never appeared:\n{''.join(lines)}"
    return code, "".join(lines)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ctrl_c_to_a_spawned_job_exit_130_without_a_traceback_and_a_checkpoint_kept(image_folder, tmp_path):
    """`--dist-init-method spawn`: the parent and its ranks are one process group. The parent waits for its ranks
    whatever comes (each stops as the Ctrl-Cs ask: the second, at once, if it reaches them before the first's stop
    ends) and adds no line; no rank exits 0."""
    argv = [str(image_folder), *SMALL_RUN, "--epochs", "2", "--checkpoints-path", str(tmp_path),
            "--dist-init-method", "spawn", "--nproc-per-node", "2", "--checkpoint-interval", "1"]
    code, output = press_ctrl_c(python_cmd(*argv), after=["epoch 1/2 step 2/", "Ctrl-C again stops at once"])
    assert code == INTERRUPTED_EXIT, output
    assert "error" not in output.lower() and "Traceback" not in output and "Exception" not in output, output
    assert "Terminating process" not in output, output  # torch's line: the parent stopped a rank that was stopping
    kept = re.search(r"stopped after step (\d+) with a checkpoint|kept \S+ \(step (\d+),", output)
    assert kept, output
    assert load_checkpoint(tmp_path / "last.pt")["step"] == int(kept.group(1) or kept.group(2))


@pytest.mark.slow
def test_a_second_ctrl_c_during_a_real_write_waits_for_it_and_the_checkpoint_is_kept(image_folder, tmp_path):
    """As a terminal sends them, to a process whose write takes seconds (tests/save_held.py): the first Ctrl-C asks
    for the stop's checkpoint, the second comes while it is written. Once said kept, it is on disk, whole."""
    argv = [str(image_folder), *SMALL_RUN, "--epochs", "1", "--checkpoints-path", str(tmp_path)]
    code, output = press_ctrl_c([sys.executable, str(REPO / "tests" / "save_held.py"), *argv],
                                after=["epoch 1/1 step 2/", "test: checkpoint write held"], timeout=120)
    assert code == INTERRUPTED_EXIT and "Traceback" not in output, output
    said = re.search(r"Ctrl-C: stopped at once after step (\d+);.*", output)
    assert said, output
    step = int(said.group(1))
    assert_names(said.group(0), tmp_path / "last.pt", f"step {step}", "nothing lost")
    assert load_checkpoint(tmp_path / "last.pt")["step"] == step
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp")]


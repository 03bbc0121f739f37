"""A run from start to end: the build steps (build.py) in their order, the Trainer over what they built,
the start-up table, then training (--evaluate is tools/evaluate.py's). Every part taken registers its release on
the run's ExitStack, so a failure at any step, and the end of the run, release them in reverse order."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

from imagenet_elastic.checkpoint.saving import Checkpointer
from imagenet_elastic.config import Config
from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.sources import Source
from imagenet_elastic.errors import UserError
from imagenet_elastic.launch import distributed
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.launch.preemption import PreemptionFlag
from imagenet_elastic.report.console import Console
from imagenet_elastic.report.restart_cost import RestartCost, process_started_at
from imagenet_elastic.report.samplelog import ENV_VAR as SAMPLE_LOG_VAR
from imagenet_elastic.report.samplelog import SampleLog
from imagenet_elastic.report.sinks import Sinks
from imagenet_elastic.train import startup_table
from imagenet_elastic.train.build import (
    Run,
    build_loaders,
    check_inputs,
    fit_micro_batches,
    join_job,
    prepare_compile,
    prepare_distillation,
    prepare_training,
    share_checkpoint,
    wrap_model,
)
from imagenet_elastic.train.loss import TrainLoss
from imagenet_elastic.train.mixing import Mixer
from imagenet_elastic.train.step import StepContext
from imagenet_elastic.train.trainer import Reports, Trainer


def build(run: Run, stack: contextlib.ExitStack, splits: Optional[tuple[Source, Source]] = None) -> Trainer:
    """Everything a run needs, from what it is given (`run`: its settings, its place in the job, where it speaks,
    its preemption flag), the stack that releases what it takes, and, where the caller holds them, the data's train
    and val sources (else DATA's, as the command line names them)."""
    began = time.time()
    config, env, console, preempt = run.config, run.env, run.console, run.preempt
    inputs, snapshot = check_inputs(run, stack, splits)
    training = prepare_training(run, inputs, snapshot)
    loaders = build_loaders(run, inputs, training, stack)
    checked = join_job(run, inputs, snapshot, stack)
    share_checkpoint(env, inputs, training, snapshot)
    del snapshot  # its tensors are in the model and optimizer now
    state = training.state
    preempt.steps_done = state.step
    classes = len(inputs.train.classes)
    compilation = prepare_compile(run, inputs, training)
    student = ModelInput(inputs.device, training.precision.dtype, config.channels_last)
    distillation = prepare_distillation(config, training, student)
    ctx = StepContext(wrap_model(state.model, compilation, env, inputs.device), state.optimizer, state.scaler,
                      TrainLoss(config.label_smoothing, config.bce_loss, config.bce_target_thresh), student,
                      Mixer(config.mixup_alpha, config.cutmix_alpha, classes) if config.mixes else None,
                      config.clip_grad_norm, config.grad_checkpointing, distillation)
    training.micro = fit_micro_batches(run, inputs, training, ctx)
    checkpointer = Checkpointer(inputs.checkpoints, config, inputs.device, env.is_main)
    sample_log = SampleLog(os.environ.get(SAMPLE_LOG_VAR), env.rank, env.world_size)
    cost = (RestartCost(training.resumed_at, process_started_at(), began, time.time(), inputs.load_seconds)
            if training.resumed_at is not None else None)
    sinks = Sinks(inputs.sinks, config.checkpoints_path, console.warn)
    trainer = Trainer(run, training, loaders, ctx, checkpointer, Reports(sinks, sample_log, compilation, cost))
    stack.callback(trainer.close)  # first out: DDP and tensors go before the process group does
    facts = startup_table.describe(console, config, env, inputs, training, loaders, checked, compilation, distillation)
    distributed.rank_0_does(lambda: sinks.start(
        state.step, state.history, training.tracker_runs, continuing=config.resume is not None or env.restart_count > 0,
        started_from=training.resumed_at, name=os.path.basename(os.path.abspath(config.checkpoints_path)),
        settings=config.to_dict(), facts=dict(facts)))
    return trainer


def run(config: Config, env: DistEnv) -> None:
    console = Console(env.is_main, config.log_interval, env.rank)
    # first: a signal during start-up is not lost; Ctrl-C too (see preemption.py)
    preempt = PreemptionFlag(config.preempt_signals, interrupts=True, speaks=env.is_main)
    try:
        run_with(Run(config, env, console, preempt))
    except UserError as error:
        # a stop that came while the rank unwound (its launcher's, once rank 0 reported) is not lost to the SIG_IGN
        # the unwinding ends with: the report then stays rank 0's (launch/processes.leave_the_report_to_rank_0)
        error.stopped_by = preempt.received
        raise
    except KeyboardInterrupt:
        if not preempt.training_began:  # once it began, the trainer said what was kept (or the stop's line did)
            console.info("Ctrl-C: stopped before training began: nothing trained, no checkpoint written")
        raise


def run_with(run: Run) -> None:
    with contextlib.ExitStack() as stack:
        # Last out. The rank is ending, with its own exit code (0, 2, 74, 75 or a crash's): a signal now
        # (torchrun's second one, or a spawn parent stopping the ranks after another one failed) would
        # only turn that code into -15 and hide why it ended.
        stack.callback(run.preempt.ignore_from_now)
        build(run, stack).fit()

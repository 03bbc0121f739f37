#!/usr/bin/env python
"""Inject faults into real torchrun jobs on this machine and print what they cost.

    python scripts/fault_injection_demo.py [--workdir DIR] [--seed N] [--kills K]

Trains the same small job (test_resnet, 32 px, 3 epochs, global batch 16) once without faults, then:
  1. K SIGKILLs of a random worker at random steps, torchrun --max-restarts=K restarting the round;
  2. SIGTERM to every worker (a preemption), then the same command with --resume;
  3. two single-worker elastic agents (c10d rendezvous): one node is killed, later a new node joins.
Each scenario's samples come from the sample log (IMAGENET_ELASTIC_SAMPLE_LOG): samples lost and samples
repeated count against the final training; steps redone are steps trained again after a rollback.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import fault_injection as fi  # beside this script (python puts the script's folder first on sys.path)

EPOCHS = 3
TRAIN_PER_CLASS, CLASSES, GLOBAL_BATCH = 48, 8, 16
STEPS_PER_EPOCH = TRAIN_PER_CLASS * CLASSES // GLOBAL_BATCH
TRAINER_ARGS = ("--model", "test_resnet", "--image-size", "32", "--batch-size", "8", "--workers", "1",
                "--log-interval", "1", "--warmup-epochs", "1", "--lr", "2.0", "--epochs", str(EPOCHS))


def make_job(workdir: Path) -> fi.Job:
    data = workdir / "data"
    if not data.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_fake_imagenet.py")), str(data),
                        "--classes", str(CLASSES), "--train-per-class", str(TRAIN_PER_CLASS), "--val-per-class", "4",
                        "--size", "48x40"], check=True, capture_output=True)
    return fi.Job(str(data), TRAINER_ARGS, STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH, workdir)


def random_targets(rng: random.Random, kills: int) -> list[tuple[int, int, int]]:
    """(epoch, step, rank) in increasing order, at least a few steps apart, never an epoch's last step."""
    picks = sorted(rng.sample([(e, s) for e in range(1, EPOCHS + 1) for s in range(2, STEPS_PER_EPOCH - 1, 4)],
                              kills))
    return [(epoch, step, rng.randint(0, 1)) for epoch, step in picks]


def table(outcomes: list[fi.Outcome]) -> str:
    head = ("scenario", "faults", "restarts", "samples lost", "samples repeated", "steps redone",
            "fault -> next step (s)", "s lost per fault", "final weights vs uninterrupted")
    rows = [head] + [(o.scenario, str(o.faults), str(o.restarts), str(o.samples_lost), str(o.samples_repeated),
                      str(o.steps_redone), ", ".join(f"{r:.1f}" for r in o.recovery_s), f"{o.seconds_lost:.1f}",
                      o.weights) for o in outcomes]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("---" for _ in head) + "|")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--seed", type=int, default=0, help="picks the kill steps and ranks")
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fault_injection_"))
    job = make_job(workdir)
    print(f"work folder {workdir}", flush=True)
    clean_wall = fi.run_clean(job)
    print(f"uninterrupted run: {clean_wall:.1f} s", flush=True)
    outcomes = [fi.worker_kills(job, random_targets(random.Random(args.seed), args.kills), EPOCHS, clean_wall)]
    print(table(outcomes[-1:]), flush=True)
    outcomes.append(fi.preemption(job, epoch=2, step=STEPS_PER_EPOCH // 2, epochs=EPOCHS, clean_wall=clean_wall))
    print(table(outcomes[-1:]), flush=True)
    outcome, _ = fi.elastic(job, kill_at=(1, STEPS_PER_EPOCH // 3), epochs=EPOCHS, clean_wall=clean_wall)
    outcomes.append(outcome)
    print(f"\nuninterrupted run {clean_wall:.1f} s; world sizes in the elastic run: "
          f"{' -> '.join(map(str, outcome.world_sizes))}\n")
    print(table(outcomes))


if __name__ == "__main__":
    main()

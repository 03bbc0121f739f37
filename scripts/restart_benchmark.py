"""Restart to first step, measured: torchrun resumes a checkpoint with N processes on this machine.

    python scripts/restart_benchmark.py [--model resnet50] [--procs 2 4] [--repeats 3]

Makes a small image folder and one checkpoint of MODEL (a ResNet-50's state, with SGD momentum, is
~200 MB), then for each N starts `torchrun --nproc-per-node N ... --resume` on a copy of it and
prints one JSON line per run: the wall time from the launch to the first training step, and the
parts the run itself reports (process start, imports, build steps with the checkpoint load, first
step). With PYTHONPATH pointing at another checkout it measures that code instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--image-size", "32", "--batch-size", "2", "--global-batch-size", "8", "--workers", "1", "--amp", "none",
       "--max-steps-per-epoch", "1", "--log-interval", "1", "--threads", "1"]
PARTS = re.compile(r"process started ([\d.]+) s after it, imports ([\d.]+) s, build steps ([\d.]+) s "
                   r"\(checkpoint load ([\d.]+) s[^)]*\), first step ([\d.]+) s")


def train(args: list[str], procs: int, env: dict[str, str]) -> tuple[float, str]:
    """Seconds from the launch to the first step's report (the whole run when it makes none), and the output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
           "-m", "imagenet_elastic", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first_step, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if first_step is None and "after the checkpoint was written" in line:
            first_step = time.perf_counter() - start
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{''.join(lines)}")
    return first_step if first_step is not None else time.perf_counter() - start, "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with tempfile.TemporaryDirectory() as scratch:
        data, saved = os.path.join(scratch, "data"), os.path.join(scratch, "saved")
        subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_fake_imagenet.py"), data, "--classes", "4",
                        "--train-per-class", "8", "--val-per-class", "2", "--size", "48x40"], check=True,
                       capture_output=True)
        train([data, "--model", args.model, *RUN, "--epochs", "1", "--checkpoints-path", saved], 1, env)
        state_mb = os.path.getsize(os.path.join(saved, "last.pt")) / 1e6
        for procs in args.procs:
            for repeat in range(args.repeats):
                folder = os.path.join(scratch, f"run{procs}_{repeat}")
                shutil.copytree(saved, folder)
                seconds, output = train([data, "--model", args.model, *RUN, "--epochs", "2", "--resume",
                                         "--checkpoints-path", folder], procs, env)
                found = PARTS.search(output)
                # "process started" counts from when the copied checkpoint was first written: not a restart's
                parts = dict(zip(("imports_s", "build_s", "load_s", "step_s"), map(float, found.groups()[1:]))) \
                    if found else {}
                print(json.dumps({"model": args.model, "state_mb": round(state_mb), "procs": procs,
                                  "launch_to_first_step_s": round(seconds, 2), **parts}), flush=True)
                shutil.rmtree(folder)


if __name__ == "__main__":
    main()

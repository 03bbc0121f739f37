"""How far the optimizer's step and the checkpoint's write are from the command line: the package's files and
functions on the call stack at those two moments of a real run (a tiny model on a CPU, one step, a synchronous save).

    python scripts/hallways.py            # one JSON line per moment: its files in call order, and the frame count

A reader who follows the calls from `imagenet_elastic.cli.main` opens these files, in this order; the counts are
the measure of the code's hallways that docs/DEVELOPMENT.md keeps. Files the build passes through before training
(train/build.py's steps) are not on these stacks: they return before the first step.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # the checkout's package; make_fake_imagenet

import make_fake_imagenet  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

from imagenet_elastic import cli  # noqa: E402
from imagenet_elastic.checkpoint import store  # noqa: E402

PACKAGE = str(REPO / "imagenet_elastic") + os.sep


def package_frames() -> list[tuple[str, str]]:
    """(file relative to the package, function) of each frame of the caller's stack inside the package, outermost
    first."""
    return [(frame.filename[len(PACKAGE):], frame.name) for frame in traceback.extract_stack()[:-2]
            if frame.filename.startswith(PACKAGE)]


def summary(moment: str, frames: list[tuple[str, str]]) -> dict:
    files = list(dict.fromkeys(name for name, _ in frames))
    return {"moment": moment, "files": len(files), "frames": len(frames), "path": files,
            "calls": [f"{name}:{function}" for name, function in frames]}


def main() -> None:
    seen: dict[str, list[tuple[str, str]]] = {}

    def at_step(_optimizer, _args, _kwargs) -> None:
        seen.setdefault("optimizer step", package_frames())

    save_to = store.save_to

    def saving(*args, **kwargs):
        seen.setdefault("checkpoint write", package_frames())
        return save_to(*args, **kwargs)

    hook = register_optimizer_step_pre_hook(at_step)
    store.save_to = saving  # the state's bytes into the temp file the commit renames
    try:
        with tempfile.TemporaryDirectory() as folder:
            for split in ("train", "val"):
                make_fake_imagenet.make_split(folder, split, num_classes=2, per_class=8, size=(40, 40), seed=0)
            cli.main([folder, "--model", "test_resnet", "--image-size", "32", "--batch-size", "8", "--epochs", "1",
                      "--max-steps-per-epoch", "1", "--workers", "0", "--threads", "1", "--amp", "none",
                      "--no-async-checkpoint", "--no-tensorboard", "--checkpoints-path",
                      os.path.join(folder, "ckpt")])
    finally:
        hook.remove()
        store.save_to = save_to
    for moment in ("optimizer step", "checkpoint write"):
        print(json.dumps(summary(moment, seen[moment])))


if __name__ == "__main__":
    main()

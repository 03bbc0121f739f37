"""The program with an out-of-memory error injected on one rank, for tests of --micro-batch auto across processes.

`python tests/oom_injected.py ARGS` runs the program with ARGS (as `python -m imagenet_elastic ARGS`; torchrun
starts it as a script the same way). On the rank $OOM_RANK, the model's classifier raises the device's
out-of-memory error for every training batch larger than $OOM_LIMIT images, as a GPU with less memory would.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # started as a script (torchrun's way): the checkout's package, before it is imported
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from imagenet_elastic.train import build  # noqa: E402

RANK, LIMIT = "OOM_RANK", "OOM_LIMIT"


def install() -> None:
    """Wrap build.create_model: on the chosen rank, its classifier refuses batches above the limit."""
    if os.environ.get("RANK", "0") != os.environ[RANK]:
        return
    limit, create = int(os.environ[LIMIT]), build.create_model

    def refuse(module: nn.Module, args: tuple) -> None:
        if module.training and args[0].shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {args[0].shape[0]} images (injected)")

    def created(*args, **kwargs) -> nn.Module:
        model = create(*args, **kwargs)
        model.get_classifier().register_forward_pre_hook(refuse)
        return model

    build.create_model = created


if __name__ == "__main__":
    install()
    from imagenet_elastic.cli import program

    program()

"""What a rank's restored training state looks like when training starts, for tests of the resume paths.

`python tests/state_probe.py ARGS` runs the program with ARGS (as `python -m imagenet_elastic ARGS`; torchrun
starts it as a script the same way) and, on every rank, just before the first step, writes
$STATE_PROBE_DIR/rank{R}.json: how many optimizer-state and EMA tensors it checked and each one whose layout
(strides), dtype or device differs from its parameter's. CUDA's fused optimizers refuse such a tensor at the
first step; the CPU kernels do not check, so on CPU this is how a test sees it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

if __name__ == "__main__":  # started as a script (torchrun's way): the checkout's package, before it is imported
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# At the top, not in share_one_gpu: a module that moved fails here, on every machine, not on a GPU's first rank
from imagenet_elastic.launch import distributed  # noqa: E402
from imagenet_elastic.launch.launchers import DistEnv  # noqa: E402
from imagenet_elastic.train import startup_table  # noqa: E402

PROBE_DIR = "STATE_PROBE_DIR"
ONE_GPU = "STATE_PROBE_ONE_GPU"  # "1": every rank on CUDA device 0, over gloo (NCCL refuses two ranks on one GPU)


def layout_of(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tuple(tensor.shape), tensor.stride(), str(tensor.dtype), str(tensor.device)


def layout_mismatches(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      ema: torch.nn.Module | None = None) -> tuple[int, list[str]]:
    """(tensors checked, one line per tensor that does not have its parameter's layout). Optimizer state is
    compared for every state tensor of its parameter's shape (momentum, Adam's moments), the average's
    parameters and buffers with the model's of the same name."""
    names = {param: name for name, param in model.named_parameters()}
    checked, wrong = 0, []
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    checked += 1
                    if layout_of(value) != layout_of(param):
                        wrong.append(f"optimizer {names[param]}.{key}: {layout_of(value)} vs {layout_of(param)}")
    if ema is not None:
        own = dict(model.state_dict(keep_vars=True))
        for name, value in ema.state_dict(keep_vars=True).items():
            checked += 1
            if layout_of(value) != layout_of(own[name]):
                wrong.append(f"average {name}: {layout_of(value)} vs {layout_of(own[name])}")
    return checked, wrong


def share_one_gpu() -> None:
    """Several ranks on one GPU, for a multi-rank CUDA test on a machine with one: each takes device 0 and the
    process group is gloo's, which moves CUDA tensors too (load-once's broadcast, DDP's all-reduce).

    Patched where the names are looked up: build.check_inputs calls `distributed.select_device`,
    distributed.init_process_group calls its module's `group_options`, and the start-up table imported its own
    `group_options` (the backend it names). tests/gpu/test_gpu_probes.py checks these on a CPU."""

    def select_device(requested: str, env: DistEnv) -> torch.device:
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)

    def group_options(device: torch.device) -> dict[str, Any]:
        return {"backend": "gloo"}

    distributed.select_device = select_device
    distributed.group_options = group_options
    startup_table.group_options = group_options


def install() -> None:
    """Wrap Trainer.fit: the report is written on every rank, after every build step, before any step."""
    from imagenet_elastic.train.trainer import Trainer

    if os.environ.get(ONE_GPU) == "1" and torch.cuda.is_available():
        share_one_gpu()
    fit = Trainer.fit

    def reporting_fit(self: Trainer) -> None:
        state = self.state
        checked, wrong = layout_mismatches(state.model, state.optimizer, state.ema.module if state.ema else None)
        path = os.path.join(os.environ[PROBE_DIR], f"rank{self.env.rank}.json")
        with open(path, "w") as f:
            json.dump({"rank": self.env.rank, "device": str(self.ctx.input.device), "checked": checked,
                       "mismatches": wrong, "resumed": self.training.resume_from is not None}, f)
        fit(self)

    Trainer.fit = reporting_fit


if __name__ == "__main__":
    install()
    from imagenet_elastic.cli import program

    program()

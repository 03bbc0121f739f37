"""The program with a smaller model than --model names, and without inductor's probe of the CPU's vector instructions,
for the test of torch's compile caches across processes (test_compile.py).

`python tests/compiled_small.py ARGS` runs the program with ARGS (as `python -m imagenet_elastic ARGS`). Inductor
then compiles the first step several times faster than test_resnet's (docs/BENCHMARKS.md), the probe (C++ builds
into each empty cache folder, before any graph) included. Neither changes what the test shows: every process runs
this same model and code generation, and its graphs reach the next process through the checkpoints' cache file or not
at all.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # started as a script: the checkout's package, before it is imported
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch import nn  # noqa: E402

from imagenet_elastic.train import build  # noqa: E402


def small_model(name: str, num_classes: int, *args, **kwargs) -> nn.Module:
    """Two convolutions with batch norm (whose buffers a compiled step updates in place), then the classifier."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def install() -> None:
    import torch._inductor.cpu_vec_isa as vector_isa

    vector_isa.valid_vec_isa_list = lambda: []  # scalar C++ kernels: nothing to probe
    build.create_model = small_model


if __name__ == "__main__":
    install()
    from imagenet_elastic.cli import program

    program()

"""The program with `pack` held in the middle, for the test of Ctrl-C during a pack.

`python tests/pack_held.py pack ARGS` runs the program as `python -m imagenet_elastic pack ARGS` does. A pool worker
that starts a training shard at sample $PACK_HOLD_FROM or later writes that shard's first sample (its temporary file
exists), appends a line to the file $PACK_HOLDING and waits there, for up to $PACK_HOLD_S seconds (120 by default),
then goes on. Once the file has a line per worker, every worker is holding: the pack is surely in the middle,
whatever the machine's load, until a signal ends it (left alone, a pack of a few hundred images can end before a
signal sent at the sight of its fourth shard reaches it).
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":  # started as a script: the checkout's package, before it is imported
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from imagenet_elastic import cli  # noqa: E402
from imagenet_elastic.data.sources import Source  # noqa: E402
from imagenet_elastic.tools import pack  # noqa: E402

HOLD_FROM, HOLDING, HOLD_S = "PACK_HOLD_FROM", "PACK_HOLDING", "PACK_HOLD_S"


def install() -> None:
    """Wrap pack.samples (what write_shard reads a shard's samples through) before the pool forks."""
    hold_from, holding, wait = int(os.environ[HOLD_FROM]), os.environ[HOLDING], float(os.environ.get(HOLD_S, "120"))
    samples = pack.samples

    def held(split: Source, start: int, stop: int):  # type: ignore[no-untyped-def]
        for n, sample in enumerate(samples(split, start, stop)):
            if n == 1 and split.role == "train" and start >= hold_from:  # the first sample is in the shard's file
                with open(holding, "a") as f:
                    f.write(f"{os.getpid()} holds the shard from sample {start}\n")
                time.sleep(wait)
            yield sample

    pack.samples = held


if __name__ == "__main__":
    install()
    cli.program()

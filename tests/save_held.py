"""The program with every checkpoint write held, for the tests of Ctrl-C during a write.

`python tests/save_held.py ARGS` runs the program as `python -m imagenet_elastic ARGS` does. Each checkpoint write,
its temporary file open, prints `test: checkpoint write held` and waits $SAVE_HOLD_S seconds (3 by default) before
it writes: a save that surely takes a moment, whatever the model and the machine. Under `--dist-init-method spawn`
the ranks, which import this file as `__mp_main__`, hold theirs too. With $SAVE_HELD_THEN_FOLDER, a folder is made at
that path once a checkpoint is written: a file the save is followed by (metrics.jsonl) refused mid-run, after the
start-up's check of the checkpoints folder.
"""

from __future__ import annotations

import os
import sys
import time

if __name__ in ("__main__", "__mp_main__"):  # started as a script: the checkout's package, before it is imported
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from imagenet_elastic import cli  # noqa: E402
from imagenet_elastic.checkpoint import store  # noqa: E402

HELD = "test: checkpoint write held"


def install() -> None:
    save_to, wait = store.save_to, float(os.environ.get("SAVE_HOLD_S", "3"))

    def held(state, file) -> None:  # type: ignore[no-untyped-def]
        print(HELD, flush=True)
        time.sleep(wait)
        save_to(state, file)
        if os.environ.get("SAVE_HELD_THEN_FOLDER"):
            os.makedirs(os.environ["SAVE_HELD_THEN_FOLDER"], exist_ok=True)

    store.save_to = held


if __name__ in ("__main__", "__mp_main__"):
    install()
if __name__ == "__main__":
    cli.program()

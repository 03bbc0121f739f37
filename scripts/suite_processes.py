"""How many Python interpreters the test suite starts, and which tests start them.

    python scripts/suite_processes.py [PYTEST ARGS ...]     # default: the whole suite, as README runs it

Each interpreter costs about 3.5 s of one core before it does anything (torch, torch._dynamo, timm: see
docs/BENCHMARKS.md), so the count, not the tests' own work, is what the suite's time follows. A `sitecustomize`
module put first on PYTHONPATH appends one line per interpreter start (its argv and the test that was running) to
a log; forked children (loader workers, pack's pool) start no interpreter and are not counted. Prints pytest's own
output, then the counts by kind and by test file, and the wall time.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOOK = '''
import json, os, sys
log = os.environ.get("SUITE_PROCESS_LOG")
if log:
    line = json.dumps({"argv": sys.argv, "orig_argv": getattr(sys, "orig_argv", []),
                       "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
'''


def kind(row: dict) -> str:
    """What an interpreter was started for, from its command line."""
    argv = " ".join(row["orig_argv"] or row["argv"])
    if not row["test"]:  # every test's processes inherit PYTEST_CURRENT_TEST; pytest and its workers don't
        return "pytest itself and its workers"
    if "torch.distributed.run" in argv or "torchrun" in argv:
        return "torchrun agents"
    if "multiprocessing" in argv and ("spawn_main" in argv or "forkserver" in argv):
        return "spawned children (ranks of --dist-init-method spawn, spawn/forkserver helpers)"
    if "imagenet_elastic" in argv or "imagenet-elastic" in argv:
        return "the program (python -m imagenet_elastic, a rank, a tool)"
    return "other (scripts, helpers)"


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as hook_dir:
        with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
            f.write(HOOK)
        log = os.path.join(hook_dir, "processes.jsonl")
        env = dict(os.environ, SUITE_PROCESS_LOG=log,
                   PYTHONPATH=os.pathsep.join(filter(None, [hook_dir, os.environ.get("PYTHONPATH")])))
        began = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "pytest", *args], env=env)
        wall = time.perf_counter() - began
        lines = Path(log).read_text().splitlines() if os.path.exists(log) else []
        rows = [json.loads(line) for line in lines]
    kinds = collections.Counter(kind(r) for r in rows)
    files = collections.Counter(r["test"].split("::")[0] for r in rows if r["test"])
    print(f"\n{len(rows)} Python interpreters started in {wall:.0f} s of wall time (pytest exit {code})")
    for name, count in kinds.most_common():
        print(f"  {count:5d}  {name}")
    print("by test file (interpreters started while its tests ran, pytest's workers left out):")
    for name, count in files.most_common():
        print(f"  {count:5d}  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""scripts/hallways.py, the measure of the code's hallways in docs/DEVELOPMENT.md: the files on the call stack from
the command line to the optimizer's step and to the checkpoint's write, taken from a real run (in this process)."""

from __future__ import annotations

import importlib.util
import json

from conftest import REPO


def test_the_stacks_at_the_step_and_the_write_lead_from_the_command_line_to_them(capfd, handlers_restored):
    spec = importlib.util.spec_from_file_location("hallways", REPO / "scripts" / "hallways.py")
    hallways = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hallways)
    hallways.main()
    lines = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    step, write = lines
    assert (step["moment"], write["moment"]) == ("optimizer step", "checkpoint write")
    assert step["path"][0] == write["path"][0] == "cli.py"
    assert step["calls"][-1] == "train/step.py:apply_gradients" and step["files"] == len(step["path"])
    assert write["calls"][-2:] == ["checkpoint/store.py:save", "atomic_files.py:write_temp"]
    assert "train/trainer.py:save" in write["calls"]

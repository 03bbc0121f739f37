"""The sbatch examples take the run's checkpoints folder as their first argument, always: a second experiment cannot
land in the first one's folder because the script's fixed job name keyed it (the submissions themselves run under the
local Slurm cluster in test_slurm.py)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO


@pytest.mark.parametrize("script", ["sbatch_task_per_gpu.sh", "sbatch_task_per_node.sh", "sbatch_srun_torchrun.sh"])
def test_an_sbatch_example_without_its_run_folder_stops_with_its_usage(script):
    for args in ([], ["/data/imagenet"]):  # nothing, and the old form: DATA alone
        done = subprocess.run(["bash", str(REPO / "scripts" / script), *args], capture_output=True, text=True,
                              timeout=30, env={"PATH": "/usr/bin:/bin", "SLURM_JOB_NAME": "imagenet-elastic"})
        assert done.returncode != 0 and "usage: sbatch" in done.stderr and "RUN_DIR DATA" in done.stderr, done.stderr
        assert done.stdout == ""

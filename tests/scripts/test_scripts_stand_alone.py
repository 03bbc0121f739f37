"""The scripts run from a copy of scripts/ alone: none reaches into tests/ (the fault-injection harness lives in
scripts/, and the tests import it from there)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import REPO, child_env


@pytest.mark.slow  # one process
def test_the_fault_injection_demo_starts_without_the_tests_folder(tmp_path):
    shutil.copytree(REPO / "scripts", tmp_path / "scripts")
    result = subprocess.run([sys.executable, str(tmp_path / "scripts" / "fault_injection_demo.py"), "--help"],
                            cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--kills" in result.stdout

"""The restart report: when this process started, and how a restart's time is split into parts."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import assert_names, labelled_seconds, restart_cost

from imagenet_elastic.report.restart_cost import FirstStep, RestartCost, process_started_at


def test_a_new_process_knows_when_it_started():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); "
                          "from imagenet_elastic.report.restart_cost import process_started_at as s; print(s())"],
                         capture_output=True, text=True, check=True)
    after = time.time()
    started = float(out.stdout)
    assert before - 0.02 <= started <= after - 0.3  # one clock tick of slack (10 ms) each side
    assert process_started_at() < before


def test_the_report_splits_the_restart_into_its_parts():
    cost = RestartCost(resumed_at=100.0, started=103.0, began=106.5, built=108.0, load_seconds=0.25)
    assert cost.describe(stepped=108.75) == (
        "first step 8.8 s after the checkpoint was written: process started 3.0 s after it, imports 3.5 s, "
        "build steps 1.5 s (checkpoint load 0.25 s), first step 0.8 s")
    unknown = RestartCost(100.0, None, 106.5, 108.0, 0.25)  # where the process's start is unknown: no such parts
    assert restart_cost(unknown.describe(108.75))[1] == {"whole": 8.8, "build steps": 1.5, "checkpoint load": 0.25,
                                                         "first step": 0.8}


def test_a_compiled_first_step_says_what_the_cache_load_and_compiling_took_and_what_the_step_itself_did():
    cost = RestartCost(resumed_at=100.0, started=103.0, began=106.5, built=108.0, load_seconds=0.25)
    first = FirstStep(compile_seconds=29.9, compiled="cache loaded from ckpt/compile_cache.bin: 2 of 2 Inductor graphs "
                      "from the caches", cache_load_seconds=0.4)
    line, numbers = restart_cost(cost.describe(139.75, first))
    assert numbers == {"whole": 39.8, "process started": 3.0, "imports": 3.5, "build steps": 1.5,
                       "checkpoint load": 0.25, "compile cache load": 0.4, "first step": 31.8, "compile": 29.9,
                       "the step itself": 1.9}
    assert_names(line, "compile 29.9 s", first.compiled, "the step itself")  # how it compiled: the cache it loaded


def test_on_cuda_the_first_step_names_cudnns_autotuning_which_no_cache_keeps():
    """The part a compile cache cannot remove: an eager ResNet-50's first step took 6.6 s on an H100."""
    eager = FirstStep(autotuned=True).describe(6.6)
    assert labelled_seconds(eager) == {"first step": 6.6}
    assert_names(eager, "eager", "cuDNN's autotuning", "no cache")
    compiled = FirstStep(12.0, "cold cache", autotuned=True).describe(18.6)
    assert labelled_seconds(compiled) == {"first step": 18.6, "compile": 12.0, "the step itself": 6.6}
    assert_names(compiled, "compile", "cold cache", "the step itself", "cuDNN's autotuning", "no cache")
    assert FirstStep().describe(0.8) == "first step 0.8 s"  # eager on a CPU: nothing more to say

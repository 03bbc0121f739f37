"""Shared fixtures: a small learnable ImageFolder on disk and helpers that start the real program."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the harness the demo script uses too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # its modules (OpCounter, synthetic_index)
import fault_injection as fi  # noqa: E402
import inprocess
import pytest
import store_servers
import torch
import warm_python as warm
from packaging.version import Version  # pytest's own dependency

REPO = Path(__file__).resolve().parents[1]

# A model and data small enough that an epoch takes a fraction of a second on 2 CPU cores; fp32 on every
# CPU kind, so that every machine trains the same bits (and `--evaluate` can be compared with training).
SMALL_RUN = ["--model", "test_resnet", "--image-size", "32", "--batch-size", "8", "--workers", "1",
             "--log-interval", "1", "--warmup-epochs", "1", "--lr", "2.0", "--amp", "none"]
AUGMENTED = ["--auto-augment", "ta_wide", "--random-erase", "0.5", "--hflip", "0.3", "--scale", "0.25", "1",
             "--ratio", "0.5", "2"]  # every per-sample augmentation option, each off its default
MIXED = ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--drop-path", "0.1"]  # drawn per step, on the device
TRAIN_IMAGES = 4 * 24
VAL_IMAGES = 4 * 9 - 1  # 35: divisible by neither 2 nor 3


def _fake_imagenet():
    """scripts/make_fake_imagenet.py as a module: its images, without an interpreter started for them."""
    spec = importlib.util.spec_from_file_location("make_fake_imagenet", REPO / "scripts" / "make_fake_imagenet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE_IMAGENET = _fake_imagenet()


def make_image_folder(root: Path, classes: int = 4, train_per_class: int = 24, val_per_class: int = 9) -> Path:
    """What `python scripts/make_fake_imagenet.py ROOT --classes .. --size 48x40` writes."""
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        FAKE_IMAGENET.make_split(str(root), split, classes, per_class, (48, 40), seed=0)
    return root


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order and groups for pytest-xdist (pyproject's addopts: three workers, `--dist loadgroup`, groups handed
    out in this order, each to the first worker with little left to do).
    1. The `multiprocess` tests, in one group, so one worker runs them one after another on every core (ranks,
       side-by-side runs; some share the local Slurm cluster, some pick free ports). Handed out one by one
       (pytest-xdist's default), two of them often ran at once, each about twice as slow.
    2. Every test that starts at most one process at a time, with its module (its fixtures are built once), on a
       core (`share_cores`): the other workers take these beside group 1, whose processes leave a core idle for
       part of their time (start-up, loader hand-offs, checkpoint writes, rendezvous).
    3. The multiprocess tests marked `mostly_waiting` (a grace period, a time-out, a rendezvous), last, a group
       for each module: whichever worker is free takes the next, so the workers share the tail (as one group, one
       worker ran all of them, ~80 s, while the others had finished).
    Before (the single-process tests first, then every multiprocess test on one worker) the suite took ~100 s
    longer on two cores; docs/BENCHMARKS.md has the figures."""
    items.sort(key=order)  # stable: file order kept within each part
    for item in items:
        module = item.nodeid.split("::")[0]
        group = ("multiprocess", module, f"multiprocess-waiting:{module}")[order(item)]
        item.add_marker(pytest.mark.xdist_group(group))


def order(item: pytest.Item) -> int:
    return 2 if item.get_closest_marker("mostly_waiting") else 0 if multiprocess(item) else 1


def multiprocess(item: pytest.Item) -> bool:
    return item.get_closest_marker("multiprocess") is not None


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist 3.8 loses every group under pytest 9 (pytest-dev/pytest-xdist#1386, hence the test extra's
    pytest<9) and would hand the multiprocess tests out one by one, to run beside each other: refuse that
    rather than run a slower, flakier suite."""
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple >= (9,) \
            and Version(importlib.metadata.version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist 3.8 does not group the tests "
                                "(pytest-dev/pytest-xdist#1386): pip install -c constraints.txt -e '.[test]' "
                                "(pytest<9), or run them in one process with -n 0")


RUNNING: dict[str, pytest.Item] = {}  # the test being set up or run in this process
CORES = sorted(os.sched_getaffinity(0))
THREADS = torch.get_num_threads()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    RUNNING["test"] = item  # before its fixtures: a shared reference run is started in some test's setup
    share_cores(item)


def share_cores(item: pytest.Item) -> None:
    """Under pytest-xdist a test that is not `multiprocess` keeps to one core (the worker's number picks it),
    and so do the processes it starts: they count one core and take one thread (distributed.default_threads),
    so the workers' processes never wait for each other's threads (a third worker shares the first core). A
    multiprocess test gets every core back."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    if not worker.startswith("gw"):
        return
    if multiprocess(item):
        os.sched_setaffinity(0, CORES)
        torch.set_num_threads(THREADS)
    else:
        os.sched_setaffinity(0, {CORES[int(worker[2:]) % len(CORES)]})
        torch.set_num_threads(1)


PROCESS_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@pytest.fixture(autouse=True)
def signals_as_found():
    """Each test leaves this process's signal handlers and mask as it found them: a test that ran the entry point in
    this process left SIGINT ignored (trainer.run's last cleanup), and a later test that sends itself a Ctrl-C in
    the same pytest-xdist worker saw nothing come. The handlers are put back, and the test that changed them fails."""
    handlers = {signum: signal.getsignal(signum) for signum in PROCESS_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    changed = [signal.Signals(signum).name for signum, handler in handlers.items()
               if signal.getsignal(signum) != handler]
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    left_blocked = signal.pthread_sigmask(signal.SIG_SETMASK, mask) != mask
    assert not changed and not left_blocked, f"the test left these signals' handlers changed: {changed}" \
        if changed else "the test left the signal mask changed"


@pytest.fixture
def handlers_restored():
    """For a test that runs what changes the process's signal handlers (the entry point ends ignoring the stop
    signals): they are put back after it."""
    saved = {signum: signal.getsignal(signum) for signum in PROCESS_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def several_at_once() -> None:
    """What `torchrun_cmd` and `start` check: a test that starts several processes at once is marked
    `multiprocess`, or the other worker would run it beside one that already keeps both cores busy."""
    item = RUNNING.get("test")
    if item is not None and not multiprocess(item):
        raise AssertionError(f"{item.nodeid} starts several processes at once: mark it @pytest.mark.multiprocess")


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    root = make_image_folder(tmp_path_factory.mktemp("data") / "imagenet")
    sorted((root / "val").rglob("*.jpg"))[-1].unlink()
    return root


@pytest.fixture(scope="session")
def one_epoch_run(image_folder, tmp_path_factory) -> Path:
    """A checkpoints folder holding a finished one-epoch run of test_resnet (3 steps) on image_folder: tests copy it
    before they change it."""
    folder = tmp_path_factory.mktemp("one_epoch")
    inprocess.train([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1", "--max-steps-per-epoch", "3",
                     "--checkpoints-path", str(folder)])
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache that huggingface_hub reads, offline: the constants its functions read at each call
    (HF_HOME and HF_HUB_OFFLINE are read once, when it is imported)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


child_env = fi.clean_env  # this environment without launcher variables, so tests stay local


@pytest.fixture(scope="session")
def warm_python(tmp_path_factory) -> str:
    """A `python` whose commands are forks of one interpreter that imported torch, torchvision and timm
    (tests/warm_python.py): for the processes a test starts that need not be new interpreters, and torchrun's
    workers (PYTHON_EXEC)."""
    with warm.serving(child_env(), tmp_path_factory.mktemp("python")) as python:
        yield python


@pytest.fixture(scope="module")
def warm_ranks(warm_python):
    """torchrun's workers, in the module that uses this, are forks of the warm python: PYTHON_EXEC in this
    environment, and so in child_env's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHON_EXEC", warm_python)
        yield


def python_cmd(*args: str, python: str = sys.executable) -> list[str]:
    """`imagenet-elastic ARGS`; `python`: the interpreter (warm_python: a fork that has imported torch)."""
    return [python, "-m", "imagenet_elastic", *args]


def torchrun_cmd(nproc: int, *args: str, restarts: int = 0) -> list[str]:
    several_at_once()
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}", "-m", "imagenet_elastic", *args]


def run(cmd: list[str], timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env or child_env(), capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str]) -> subprocess.Popen:
    """`cmd` in the background, beside the test's next run (an uninterrupted reference beside the run that
    is killed: on CI's two cores the two take little longer than one). `finish` collects it."""
    several_at_once()
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_and_kill(cmd: list[str], when: str, victim, timeout: float = 240, sig: int = signal.SIGKILL,
                 env: dict[str, str] | None = None) -> tuple[int, str]:
    """Start `cmd`, send `sig` to the process(es) `victim(proc)` returns once a line containing `when` appears.

    Returns (exit code, full output). Fails the test when the trigger line never shows.
    """
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    killed = threading.Event()

    def reader() -> None:
        for line in proc.stdout:
            lines.append(line)
            if when in line and not killed.is_set():
                victims = victim(proc)
                for pid in victims if isinstance(victims, list) else [victims]:
                    os.kill(pid, sig)
                lines.append(f"<<< test: {signal.Signals(sig).name} sent after {when!r} >>>\n")
                killed.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        thread.join(timeout=10)
    output = "".join(lines)
    assert killed.is_set(), f"trigger {when!r} never appeared:\n{output}"
    return code, output


def torchrun_workers(proc: subprocess.Popen) -> list[int]:
    """A victim picker for run_and_kill: every worker of a torchrun agent."""
    return [torchrun_worker(rank)(proc) for rank in range(2)]


def torchrun_worker(rank: int):
    """A victim picker for run_and_kill: the torchrun worker process with RANK=rank."""
    def pick(proc: subprocess.Popen) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if rank in (workers := fi.workers_by_rank(proc.pid)):
                return workers[rank]
            time.sleep(0.05)
        raise AssertionError(f"no torchrun worker with RANK={rank}")
    return pick


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_tensors(a: dict, b: dict) -> None:
    """Bitwise equality of two (nested) state dicts."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{key} differs"
        elif isinstance(a[key], dict):
            assert_same_tensors(a[key], b[key])
        else:
            assert a[key] == b[key], f"{key}: {a[key]!r} != {b[key]!r}"


EPOCHS = 3


@pytest.fixture(scope="session")
def torchrun_reference(image_folder, tmp_path_factory, warm_python):
    """An uninterrupted 2-process torchrun run of 3 epochs: the run every fault-tolerance result is compared with.
    Its ranks are forks of the warm python."""
    ckpt = tmp_path_factory.mktemp("reference")
    result = run(torchrun_cmd(2, str(image_folder), *SMALL_RUN, "--epochs", str(EPOCHS),
                              "--keep-checkpoints", "2", "--checkpoints-path", str(ckpt)),
                 env=child_env(PYTHON_EXEC=warm_python))
    assert result.returncode == 0, result.stdout + result.stderr
    return ckpt, result.stdout


# One short epoch: what every launcher test trains, and what they all must reproduce bitwise.
SHORT_RUN = [*SMALL_RUN, "--epochs", "1", "--max-steps-per-epoch", "3"]


@pytest.fixture(scope="session")
def reference_world2(image_folder, tmp_path_factory, warm_python) -> dict:
    """The state every 2-rank launcher must reproduce bitwise: torchrun, one node, one thread per rank (forks of
    the warm python)."""
    ckpt = tmp_path_factory.mktemp("ref2")
    result = run(torchrun_cmd(2, str(image_folder), *SHORT_RUN, "--checkpoints-path", str(ckpt)),
                 env=child_env(PYTHON_EXEC=warm_python))
    assert result.returncode == 0, result.stdout + result.stderr
    return load_checkpoint(ckpt / "last.pt")


def evaluate_args(image_folder: Path, checkpoint: Path, scratch: Path, *extra: str) -> list[str]:
    """`--evaluate` of a checkpoint, with SMALL_RUN's model and precision."""
    return [str(image_folder), *SMALL_RUN, *extra, "--evaluate", "--resume", str(checkpoint), "--checkpoints-path",
            str(scratch)]


def evaluate_cmd(image_folder: Path, checkpoint: Path, world_size: int, scratch: Path, *extra: str) -> list[str]:
    args = evaluate_args(image_folder, checkpoint, scratch, *extra)
    return python_cmd(*args) if world_size == 1 else torchrun_cmd(world_size, *args)


def evaluated(result: subprocess.CompletedProcess) -> dict:
    """The JSON line an --evaluate run ends with."""
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def evaluate_checkpoint(image_folder: Path, checkpoint: Path, world_size: int, scratch: Path,
                        *extra: str) -> dict:
    """`--evaluate`'s JSON line: one rank in this process (inprocess.command), more under torchrun."""
    if world_size == 1:
        return evaluated(inprocess.command([*evaluate_args(image_folder, checkpoint, scratch, *extra), "--workers",
                                            "0"]))
    return evaluated(run(evaluate_cmd(image_folder, checkpoint, world_size, scratch, *extra)))


def assert_row_describes(row: dict, evaluated: dict, rel: float = 1e-6) -> None:
    """A metrics.jsonl row is what `--evaluate` of that epoch's checkpoint gives."""
    assert (row["val_top1"], row["val_top5"], row["val_samples"]) == (
        evaluated["val_top1"], evaluated["val_top5"], evaluated["val_samples"]), (row, evaluated)
    assert row["val_loss"] == pytest.approx(evaluated["val_loss"], rel=rel), (row, evaluated)


def assert_matches_reference(ckpt_dir: Path, reference: dict) -> None:
    state = load_checkpoint(ckpt_dir / "last.pt")
    assert state["world_size"] == reference["world_size"]
    assert_same_tensors(state["model"], reference["model"])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server, shared by the whole test run: tests use buckets of their own (or reset() it)."""
    with store_servers.S3Server(log_dir=tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A GCS emulator, shared by the whole test run: tests use buckets of their own."""
    with store_servers.GcsServer(log_dir=tmp_path_factory.mktemp("gcs")) as server:
        yield server


@pytest.fixture
def fresh_s3_server(tmp_path):
    """An S3 server of this test's own, to stop, kill and restart."""
    with store_servers.S3Server(log_dir=tmp_path / "logs") as server:
        yield server


@pytest.fixture
def range_http_server(tmp_path):
    """range_http_server(folder) -> a started RangeHTTPServer of `folder`, stopped after the test."""
    with contextlib.ExitStack() as started:
        yield lambda folder: started.enter_context(store_servers.RangeHTTPServer(folder, log_dir=tmp_path / "logs"))


@pytest.fixture
def fault_proxy(tmp_path):
    """fault_proxy(upstream) -> a started FaultProxy in front of a server (or "host:port"), stopped after the
    test."""
    with contextlib.ExitStack() as started:
        yield lambda upstream: started.enter_context(store_servers.FaultProxy(upstream, log_dir=tmp_path / "logs"))


def tree_digest(root: Path) -> dict[str, str]:
    """Every file's hash, except the lock file (it names its latest holder), the file-list caches
    (index-*.npz: rebuilt from the data folder whenever it changes) and the curves (steps.jsonl,
    tensorboard/): a run that trained steps before it met a corrupt image logged them, and the next
    resume drops what lies beyond its checkpoint (test_step_log.py)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in (".lock", "steps.jsonl")
            and not p.match("index-*.npz") and "tensorboard" not in p.relative_to(root).parts}


def assert_names(text: str, *parts: object) -> None:
    """Every one of `parts` (each as str()) appears in `text`, in this order: each after the end of the one before.
    The values a message must carry (paths, flags, numbers), not the sentence around them. A part is matched whole:
    one that begins (ends) with a letter or digit is not a piece of a longer word or number, so "8" is not found in
    "18", "8.5", "1,800" or "epoch_0008"."""
    at, previous = 0, None
    for part in map(str, parts):
        found = find_whole(text, part, at)
        if found < 0:
            where = "not" if find_whole(text, part, 0) < 0 else f"not after {previous!r}"
            raise AssertionError(f"{part!r} is {where} in {text!r}")
        at, previous = found + len(part), part


def find_whole(text: str, part: str, start: int) -> int:
    """Where `part` first lies whole in `text` from `start` (assert_names), or -1."""
    def word(i: int) -> bool:  # text[i] continues a word or a number
        if not 0 <= i < len(text):
            return False
        if text[i] in ".,":  # 1.5, 1,800: a number goes on
            return 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit()
        return text[i].isalnum() or text[i] == "_"

    found = text.find(part, start)
    while found >= 0 and part:
        end = found + len(part)
        if not ((part[0].isalnum() and word(found - 1)) or (part[-1].isalnum() and word(end))):
            return found
        found = text.find(part, found + 1)
    return found


def single_line(text: str) -> str:
    """`text`, which must be a single line (a trailing newline aside)."""
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines, not one: {text!r}"
    return lines[0]


RESTART_LINE = re.compile(r"first step (-?[\d.]+) s after the checkpoint was written: (.*)")


def labelled_seconds(text: str) -> dict[str, float]:
    """Every `LABEL N s` of `text` (`imports 3.5 s`, `the step itself 1.9 s`): {LABEL: N}; no label twice."""
    numbers: dict[str, float] = {}
    for label, value in re.findall(r"([a-z][a-z ]*?) (-?\d+(?:\.\d+)?) s\b", text):
        assert label not in numbers, f"{label!r} twice in {text!r}"
        numbers[label] = float(value)
    return numbers


def restart_cost(output: str) -> tuple[str, dict[str, float]]:
    """The restart line a resumed run prints once after its first step (report/restart_cost.py): the line, and its
    numbers by their labels: "whole" (the first step's time after the checkpoint was written) and those the line
    holds of "process started", "imports", "build steps", "checkpoint load", "compile cache load", "first step",
    "compile", "the step itself". Checked here, as every such line must hold (to its rounding): the parts sum to the
    whole, the loads are parts of the build steps, compiling and the step itself parts of the first step."""
    found = [(line, match) for line in output.splitlines() if (match := RESTART_LINE.search(line))]
    assert len(found) == 1, f"{len(found)} restart lines, not one:\n{output}"
    line, match = found[0]
    numbers = {"whole": float(match.group(1)), **labelled_seconds(match.group(2))}
    assert {"build steps", "checkpoint load", "first step"} <= numbers.keys(), line
    whole, build, first = numbers["whole"], numbers["build steps"], numbers["first step"]
    if "process started" in numbers:  # where /proc tells when this process started
        parts = numbers["process started"] + numbers["imports"] + build + first
        assert parts == pytest.approx(whole, abs=0.26), line  # five numbers rounded to 0.1
    assert 0 <= build <= whole + 0.1 and 0 <= first <= whole + 0.1, line
    assert 0 <= numbers["checkpoint load"] <= build + 0.06, line
    assert numbers.get("compile cache load", 0) <= build + 0.06, line
    if "compile" in numbers:
        assert numbers["compile"] + numbers["the step itself"] == pytest.approx(first, abs=0.16), line
    return line, numbers


def expect_user_error(args: list[str], culprit: str | tuple[str, ...], watched: Path, process: bool = False) -> str:
    """`imagenet-elastic ARGS` refuses: exit 2, one error line (warnings aside) that names `culprit` (a tuple: every
    part of it, in order, as assert_names), no traceback, and every file under `watched` as it was. In this process
    without loader workers, unless `process`: a real process with the workers ARGS ask for."""
    before = tree_digest(watched)
    result = run(python_cmd(*args)) if process else inprocess.command([*args, "--workers", "0"])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert lines[0].startswith("imagenet-elastic: error: ")
    if isinstance(culprit, str):
        assert culprit in lines[0], lines[0]
    else:
        assert_names(lines[0], *culprit)
    assert tree_digest(watched) == before, "a failed run changed files on disk"
    return lines[0]


def json_lines(result) -> list[dict]:
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def compiled_run(args: list[str], caches) -> subprocess.CompletedProcess:
    """The program with a small model (tests/compiled_small.py), compiled by inductor, in a process whose own compile
    caches are in `caches` (a folder)."""
    env = child_env(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "compiled_small.py"), *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result

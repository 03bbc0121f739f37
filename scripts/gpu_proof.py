#!/usr/bin/env python3
"""The GPU proof: one run of at most 8 minutes on one H100 that answers every target of docs/BENCHMARKS.md.

    python3 scripts/gpu_proof.py OUT [--data DIR] [--scratch DIR] [--budget SECONDS]
    python3 scripts/gpu_proof.py OUT --redo EARLIER/proof.jsonl --budget 180 \
        [--compile-cache EARLIER/compile_cache.bin.gz]

What runs, and what runs beside what (the GPU's timings never share the device; the rest overlaps):
- `versions`, then every test marked `cuda` (pytest, independent modules side by side where pytest-xdist is
  installed), while `data` writes the photographs' crops (CPU) and then `restart` trains its first round: the run's
  only cold compile, into a compile cache folder that every later part reads;
- `restart`'s second round, alone: a resume in a process whose torch caches are empty (another node), warm through
  CHECKPOINTS/compile_cache.bin alone; its restart line says where the first step's time went;
- `throughput`, alone, in one process (the model compiled once): the compiled model on batches already on the
  device (the limit), compiled end to end with --decode cpu and --decode gpu at the node's loader workers and at 4,
  the recipe's augmentation (176 px, ta_wide, erasing 0.1) under both decodes eager with its no-policy reference,
  and each JPEG library of --decode gpu;
- `targets`: every target, its figure and whether it holds.

Time guard: before each part or case, its estimate (an H100's, below) is held against the time left; one that
would not finish in time is skipped and says so, and a part that runs past the budget is stopped. Every line
goes to OUT/proof.jsonl and stdout as it comes; logs to OUT/*.log; the compile cache to OUT/compile_cache.bin.gz,
so that `--redo` on a fresh machine, with that file, runs what was skipped or failed without a cold compile.

MODEL, BATCH, SIZE, BATCHES and FEW_WORKERS from the environment make it small (tests/scripts/test_gpu_proof.py runs
it on a CPU with a tiny model); the defaults are resnet50, 256, 224, 40 measured batches and 4.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("MODEL", "resnet50")
BATCH = int(os.environ.get("BATCH", "256"))
SIZE = int(os.environ.get("SIZE", "224"))
BATCHES = int(os.environ.get("BATCHES", "40"))
FEW_WORKERS = int(os.environ.get("FEW_WORKERS", "4"))
RECIPE_SIZE = SIZE * 176 // 224  # torchvision's v2 recipe trains at 176 px for 224 px validation
# a test module that holds a test marked cuda (a decorator, or the whole module)
CUDA_MARK = re.compile(r"^(@pytest\.mark\.cuda|pytestmark = .*pytest\.mark\.cuda)", re.MULTILINE)
RECIPE = ["--auto-augment", "ta_wide", "--random-erase", "0.1"]

# Seconds each part or case takes on one H100 (resnet50, batch 256; docs/BENCHMARKS.md): the time guard's estimates.
# A throughput case: `case` for its run, and before its first run a model of its settings: `model` eager, `warm`
# compiled from the caches the restart filled (or --compile-cache), `cold` compiled from nothing.
ESTIMATES = {"versions": 10, "data": 40, "tests": 150, "restart": 150, "restart_warm": 75, "throughput": 30,
             "case": 20, "model": 15, "warm": 30, "cold": 110}
WARM_RESTART = 70  # the first round when a compile cache came with the run (--compile-cache)
# The targets (docs/BENCHMARKS.md): end to end compiled against the compiled model alone, at the node's workers and at
# FEW_WORKERS; the recipe under --decode gpu against the same without the policy; a warm restart's first step.
END_TO_END_OF_LIMIT = {"many": 0.95, "few": 0.9}
RECIPE_OF_PLAIN = 0.9
RESTART_FIRST_STEP_SECONDS = 10.0


def workers() -> int:
    """The node's loader workers: its cores less two (the training process and its feeder), fewer where /dev/shm
    cannot hold each worker's batches in flight (2 uint8 batches of BATCH x SIZE x SIZE x 3)."""
    cores = (os.cpu_count() or 2) - 2
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    fit = free // 2 // (2 * BATCH * SIZE * SIZE * 3 + 1)  # half of /dev/shm, a margin for the val loader
    return max(1, min(cores, fit))


# ----------------------------------------------------------------------------- the cases of one throughput process

@dataclass(frozen=True)
class Case:
    name: str
    flags: tuple[str, ...]  # the benchmark's command-line flags (imagenet_elastic.tools.benchmark)
    mode: str = "end_to_end"


def cases(many: int) -> list[Case]:
    """In order of the targets they answer, so that a run short of time loses the least."""
    compiled = ("--image-size", str(SIZE), "--amp", "bf16", "--channels-last", "--compile")
    eager_recipe = ("--image-size", str(RECIPE_SIZE), "--amp", "bf16", "--channels-last", "--no-compile")
    return [Case("limit", compiled, mode="synthetic"),
            Case(f"cpu_{many}", (*compiled, "--decode", "cpu", "--workers", str(many))),
            Case(f"gpu_{many}", (*compiled, "--decode", "gpu", "--workers", str(many))),
            Case(f"cpu_{FEW_WORKERS}", (*compiled, "--decode", "cpu", "--workers", str(FEW_WORKERS))),
            Case(f"gpu_{FEW_WORKERS}", (*compiled, "--decode", "gpu", "--workers", str(FEW_WORKERS))),
            Case("recipe_gpu", (*eager_recipe, *RECIPE, "--decode", "gpu", "--workers", str(many))),
            Case("plain_gpu", (*eager_recipe, "--decode", "gpu", "--workers", str(many))),
            Case("recipe_cpu", (*eager_recipe, *RECIPE, "--decode", "cpu", "--workers", str(many))),
            Case("plain_cpu", (*eager_recipe, "--decode", "cpu", "--workers", str(many))),
            Case(f"gpu_{many}_nvimgcodec", (*compiled, "--decode", "gpu", "--gpu-decoder", "nvimgcodec", "--workers",
                                            str(many))),
            Case(f"gpu_{FEW_WORKERS}_nvimgcodec", (*compiled, "--decode", "gpu", "--gpu-decoder", "nvimgcodec",
                                                   "--workers", str(FEW_WORKERS)))]


def load_compile_cache(path: Optional[str]) -> Optional[str]:
    """torch's caches filled from a CHECKPOINTS/compile_cache.bin (the restart part's, or an earlier run's): what
    happened, for the log."""
    if not path or not os.path.exists(path):
        return None
    import torch

    from imagenet_elastic.models import compile_cache

    if not compile_cache.supported():
        return f"unsupported by torch {torch.__version__}"
    data = Path(path).read_bytes()
    _, blob = compile_cache.decode(gzip.decompress(data) if path.endswith(".gz") else data)
    return "loaded" if torch.compiler.load_cache_artifacts(blob) is not None else "not loaded"


def measure(data: str, names: list[str], deadline: float, many: int, cache: Optional[str]) -> None:
    """The throughput process: each named case in order, one JSON line each, skipped when its estimate passes the
    deadline. Cases that share a model's settings share its step context, so the model compiles once."""
    sys.path.insert(0, str(REPO))
    import torch

    from imagenet_elastic.data import sources
    from imagenet_elastic.tools import benchmark, throughput

    state = load_compile_cache(cache)
    emit({"throughput": "compile cache", "state": state})
    warm = state == "loaded" or os.environ.get("PROOF_WARM") == "1"  # the restart's first round filled the caches
    train = sources.open_source(sources.train_location(data), "train", None)
    contexts: dict[tuple, Any] = {}
    for case in (c for c in cases(many) if c.name in names):
        common = ["--model", MODEL, "--batch-size", str(BATCH), "--batches", str(BATCHES), "--mode", case.mode]
        args = benchmark.build_parser().parse_args([data, *common, *case.flags])
        key = (args.image_size, args.amp, args.channels_last, args.compile)
        model = "warm" if warm else "cold"
        estimate = ESTIMATES["case"] + (0 if key in contexts else ESTIMATES[model if args.compile else "model"])
        left = deadline - time.time()
        if estimate > left:
            emit({"case": case.name, "status": "skipped", "why": f"estimate {estimate} s, {left:.0f} s left"})
            continue
        if key not in contexts:
            contexts.clear()  # one model on the device at a time
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            contexts[key] = throughput.step_context(args, len(train.classes))
        start = time.time()
        try:
            if case.mode == "synthetic":
                line = throughput.run_synthetic(args, len(train.classes), contexts[key])
            else:
                line = throughput.run_end_to_end(args, train, args.workers, contexts[key])
        except Exception as error:  # one case's failure costs that case
            emit({"case": case.name, "status": "failed", "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        emit({"case": case.name, "status": "ok", "seconds": round(time.time() - start, 1), "mode": case.mode, **line})


# ----------------------------------------------------------------------------- the driver

OUT_LINES: Optional[Path] = None  # OUT/proof.jsonl: every line of the driver and of its throughput process
LOCK = threading.Lock()


def emit(line: dict[str, Any]) -> None:
    text = json.dumps(line)
    with LOCK:
        print(text, flush=True)
        if OUT_LINES is not None:
            with open(OUT_LINES, "a") as f:
                f.write(text + "\n")


@dataclass
class Proof:
    out: Path
    data: Path
    scratch: Path
    budget: float
    compile_cache: Optional[str]
    started: float = field(default_factory=time.time)
    lines: list[dict[str, Any]] = field(default_factory=list)
    data_ok: bool = False
    restart_ok: bool = False

    def left(self) -> float:
        return self.budget - (time.time() - self.started)

    def record(self, line: dict[str, Any]) -> dict[str, Any]:
        with LOCK:
            self.lines.append(line)
        emit(line)
        return line

    def env(self, **extra: str) -> dict[str, str]:
        """Children find the package in the repository, and torch's compile caches in one folder (the restart's
        first round fills it; every later compile reads it)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.scratch / "inductor"))
        env.setdefault("TRITON_CACHE_DIR", str(self.scratch / "triton"))
        return env

    def run(self, part: str, command: list[str], log: str, estimate: Optional[float] = None, lines: bool = False,
            **env: str) -> Optional[subprocess.CompletedProcess]:
        """A part's process, under the time guard: skipped (None) when its estimate passes the time left, stopped
        at the budget's end. Its output goes to OUT/`log` (`lines`: its stdout is JSON lines, passed on as they
        come); a line says how it ended."""
        estimate = ESTIMATES.get(part, 0) if estimate is None else estimate
        if estimate > self.left():
            self.record({"part": part, "status": "skipped", "why": f"estimate {estimate:.0f} s, "
                                                                   f"{self.left():.0f} s left"})
            return None
        start = time.time()
        with open(self.out / log, "a") as sink:
            sink.write(f"$ {' '.join(command)}\n")
            sink.flush()
            try:
                done = subprocess.run(command, cwd=REPO, env=self.env(**env), stdout=None if lines else subprocess.PIPE,
                                      stderr=sink, text=True, timeout=max(1.0, self.left()))
            except subprocess.TimeoutExpired as expired:
                self.record({"part": part, "status": "timed out", "seconds": round(time.time() - start, 1)})
                sink.write(expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes)
                           else expired.stdout or "")
                return None
            sink.write(done.stdout or "")
        status = "ok" if done.returncode == 0 else "failed"
        self.record({"part": part, "status": status, "exit": done.returncode, "seconds": round(time.time() - start, 1)})
        return done

    # ------------------------------------------------------------------------- parts

    def versions(self) -> None:
        code = ("import json, os, platform, torch, torchvision, timm\n"
                "cuda = torch.cuda.is_available()\n"
                "try:\n    import nvidia.nvimgcodec as n; nvimgcodec = n.__version__\n"
                "except Exception:\n    nvimgcodec = None\n"
                "print(json.dumps({'versions': {'python': platform.python_version(), 'torch': torch.__version__,"
                " 'torchvision': torchvision.__version__, 'timm': timm.__version__, 'cuda': torch.version.cuda,"
                " 'cudnn': torch.backends.cudnn.version(), 'nvimgcodec': nvimgcodec},"
                " 'gpu': torch.cuda.get_device_name(0) if cuda else None, 'cpus': os.cpu_count(),"
                " 'date': __import__('datetime').date.today().isoformat()}))")
        done = self.run("versions", [sys.executable, "-c", code], "log.txt")
        if done is not None and done.returncode == 0:
            self.record(json.loads(done.stdout.strip().splitlines()[-1]))

    def make_data(self) -> bool:
        if (self.data / "train").is_dir():
            self.record({"part": "data", "status": "ok", "data": str(self.data), "made": False})
            return True
        photos = os.environ.get("PHOTOS")  # a folder of photographs; by default scikit-image's, else shapes on noise
        kind = ["--photos", photos] if photos else ["--photos"] if has("skimage") else []
        command = [sys.executable, "scripts/make_fake_imagenet.py", str(self.data), *kind,
                   "--classes", os.environ.get("CLASSES", "100"),
                   "--train-per-class", os.environ.get("TRAIN_PER_CLASS", "128"), "--val-per-class", "2",
                   "--size", os.environ.get("IMAGE", "500x375")]
        done = self.run("data", command, "log.txt")
        if not kind:
            self.record({"data": "shapes on noise: no photographs (PHOTOS=DIR, or pip install scikit-image)"})
        return done is not None and done.returncode == 0

    def tests(self) -> None:
        modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                         if CUDA_MARK.search(p.read_text()))
        # a module a process: the host-wait checks of one module never share the device with its own other tests;
        # where no GPU is visible every one skips, in one process
        parallel = ["-n", str(min(3, len(modules))), "--dist", "loadfile"] if has("xdist") and gpu_visible() else []
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *parallel,
                   "-m", "cuda", "-rfE", *modules]
        done = self.run("tests", command, "cuda_tests.log")
        if done is not None:
            summary = (self.out / "cuda_tests.log").read_text().strip().splitlines()
            failed = [line for line in summary if line.startswith(("FAILED", "ERROR"))]
            self.record({"tests": " ".join(modules), "summary": summary[-1] if summary else "", "failed": failed})

    def restart(self, data_ready: threading.Event) -> None:
        """Round 1 trains an epoch of a few steps, compiled (the cold compile: torch's caches fill the shared
        folder, and CHECKPOINTS/compile_cache.bin is written); round 2 (`restart_warm`, run alone) resumes."""
        data_ready.wait()
        if not self.data_ok:
            self.record({"part": "restart", "status": "skipped", "why": "no data"})
            return
        at = self.scratch / "restart"
        shutil.rmtree(at, ignore_errors=True)
        (at / "ckpt").mkdir(parents=True)
        if self.compile_cache:  # an earlier run's: this round starts warm too
            data = Path(self.compile_cache).read_bytes()
            unpacked = gzip.decompress(data) if self.compile_cache.endswith(".gz") else data
            (at / "ckpt" / "compile_cache.bin").write_bytes(unpacked)
        done = self.run("restart", [sys.executable, "-m", "imagenet_elastic", *self.restart_args(), "--epochs", "1"],
                        "restart_round1.log", estimate=WARM_RESTART if self.compile_cache else None)
        self.restart_ok = done is not None and done.returncode == 0
        if (at / "ckpt" / "compile_cache.bin").exists():  # compressed: Triton's kernels shrink several times
            packed = gzip.compress((at / "ckpt" / "compile_cache.bin").read_bytes(), 6)
            (self.out / "compile_cache.bin.gz").write_bytes(packed)

    def restart_args(self) -> list[str]:
        return [str(self.data), "--model", MODEL, "--batch-size", str(BATCH), "--image-size", str(SIZE), "--compile",
                "--max-steps-per-epoch", os.environ.get("RESTART_STEPS", "10"), "--log-interval", "5",
                "--checkpoints-path", str(self.scratch / "restart" / "ckpt")]

    def restart_warm(self) -> None:
        if not getattr(self, "restart_ok", False):
            self.record({"part": "restart_warm", "status": "skipped", "why": "the first round did not finish"})
            return
        empty = self.scratch / "restart" / "empty"  # another node: torch's own caches empty
        done = self.run("restart_warm", [sys.executable, "-m", "imagenet_elastic", *self.restart_args(), "--epochs",
                                         "2", "--resume"], "restart_round2.log",
                        TORCHINDUCTOR_CACHE_DIR=str(empty / "inductor"), TRITON_CACHE_DIR=str(empty / "triton"))
        if done is None:
            return
        said = [line.strip() for line in (self.out / "restart_round2.log").read_text().splitlines()
                if "after the checkpoint was written" in line]
        self.record({"restart": said[-1] if said else None, **restart_seconds(said[-1] if said else "")})

    def throughput(self, names: list[str]) -> None:
        if not self.data_ok:
            self.record({"part": "throughput", "status": "skipped", "why": "no data"})
            return
        cache = self.out / "compile_cache.bin.gz"
        command = [sys.executable, str(Path(__file__).resolve()), str(self.out), "--data", str(self.data),
                   "--measure", ",".join(names), "--deadline", str(self.started + self.budget),
                   "--workers", str(workers()), *(["--compile-cache", str(cache)] if cache.exists() else [])]
        before = len(read_lines(self.out / "proof.jsonl"))
        self.run("throughput", command, "throughput.log", lines=True, PROOF_WARM=str(int(self.restart_ok)))
        with LOCK:  # the child wrote its lines to proof.jsonl and stdout
            self.lines += read_lines(self.out / "proof.jsonl")[before:]

    def targets(self) -> None:
        self.record({"targets": judge(self.lines, workers())})


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()] if path.exists() else []


def gpu_visible() -> bool:
    """Whether an NVIDIA device node exists and CUDA_VISIBLE_DEVICES does not hide every device (without importing
    torch in this driver)."""
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() not in ("", "-1")


def has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def restart_seconds(line: str) -> dict[str, Optional[float]]:
    """The restart line's total and its first step's own seconds (report.restart_cost.RestartCost.describe)."""
    total = re.search(r"first step ([\d.]+) s after the checkpoint", line)
    step = re.findall(r"first step ([\d.]+) s(?! after)", line)
    return {"after_checkpoint_s": float(total.group(1)) if total else None,
            "first_step_s": float(step[-1]) if step else None}


def judge(lines: list[dict[str, Any]], many: int) -> list[dict[str, Any]]:
    """Every target against the figures the run took: what it is, its figure, and whether it holds (None: not
    measured)."""
    rate = {line["case"]: line.get("images_per_sec") for line in lines if "case" in line and line.get("status") == "ok"}

    def ratio(a: str, b: str) -> Optional[float]:
        return round(rate[a] / rate[b], 3) if rate.get(a) and rate.get(b) else None

    tests = next((line for line in lines if "tests" in line), None)
    restart = next((line for line in lines if "restart" in line and "first_step_s" in line), None)
    out = [{"target": "every CUDA test passes", "figure": tests["summary"] if tests else None,
            "holds": None if tests is None else not tests["failed"] and "passed" in tests["summary"]}]
    for gpu, cpu in ((f"gpu_{many}", f"cpu_{many}"), (f"gpu_{FEW_WORKERS}", f"cpu_{FEW_WORKERS}"),
                     ("recipe_gpu", "recipe_cpu"), ("plain_gpu", "plain_cpu")):
        r = ratio(gpu, cpu)
        out.append({"target": f"{gpu} >= {cpu}", "figure": r, "holds": None if r is None else r >= 1.0})
    for decode in ("gpu", "cpu"):
        for workers_, key in ((many, "many"), (FEW_WORKERS, "few")):
            r = ratio(f"{decode}_{workers_}", "limit")
            out.append({"target": f"{decode}_{workers_} compiled >= {END_TO_END_OF_LIMIT[key]} of the compiled limit",
                        "figure": r, "holds": None if r is None else r >= END_TO_END_OF_LIMIT[key]})
    r = ratio("recipe_gpu", "plain_gpu")
    out.append({"target": f"recipe_gpu >= {RECIPE_OF_PLAIN} of plain_gpu", "figure": r,
                "holds": None if r is None else r >= RECIPE_OF_PLAIN})
    step = restart.get("first_step_s") if restart else None
    out.append({"target": f"a warm restart's first step <= {RESTART_FIRST_STEP_SECONDS} s", "figure": step,
                "holds": None if step is None else step <= RESTART_FIRST_STEP_SECONDS})
    return out


def to_redo(path: str) -> tuple[set[str], list[str]]:
    """From an earlier run's proof.jsonl: the parts and throughput cases that were skipped, failed or timed out."""
    lines = read_lines(Path(path))
    parts = {line["part"] for line in lines if "part" in line and line.get("status") != "ok"}
    failed_tests = any(line.get("failed") for line in lines if "tests" in line)
    if failed_tests:
        parts.add("tests")
    done = {line["case"] for line in lines if "case" in line and line.get("status") == "ok"}
    names = [line["case"] for line in lines if "case" in line and line["case"] not in done]
    if "throughput" in parts and not names:
        names = [case.name for case in cases(workers())]
    if names:  # their ratios need the limit of this machine, measured again beside them
        names = ["limit", *[n for n in names if n != "limit"]]
    return parts - {"throughput", "versions", "data"}, names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="where the lines, the logs and the compile cache go")
    p.add_argument("--data", default="/tmp/gpu_data", help="the photographs' crops (written when missing)")
    p.add_argument("--scratch", default="/tmp/gpu_proof", help="checkpoints and torch's caches")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--redo", metavar="PROOF_JSONL", help="only what that run skipped or failed")
    p.add_argument("--compile-cache", metavar="FILE", help="a compile_cache.bin (.gz) to start warm from")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # the throughput process: these cases
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    global OUT_LINES
    OUT_LINES = out / "proof.jsonl"
    if a.measure is not None:
        measure(a.data, a.measure.split(","), a.deadline, a.workers, a.compile_cache)
        return
    proof = Proof(out, Path(a.data), Path(a.scratch), a.budget, a.compile_cache)
    proof.scratch.mkdir(parents=True, exist_ok=True)
    parts, names = ({"tests", "restart", "restart_warm"}, [c.name for c in cases(workers())]) if a.redo is None \
        else to_redo(a.redo)
    if "restart_warm" in parts:
        parts.add("restart")  # the second round resumes the first's checkpoint
    proof.record({"proof": "start", "budget_s": a.budget, "parts": sorted(parts), "cases": names,
                  "workers": workers(), "model": MODEL, "batch": BATCH, "size": SIZE})
    proof.versions()
    data_ready = threading.Event()

    def data() -> None:
        proof.data_ok = proof.make_data()
        data_ready.set()

    beside = [threading.Thread(target=data)]
    if "restart" in parts:
        beside.append(threading.Thread(target=proof.restart, args=(data_ready,)))
    for thread in beside:
        thread.start()
    if "tests" in parts:
        proof.tests()  # on the GPU beside the first round's compile (CPU-bound) and the data (CPU)
    for thread in beside:
        thread.join()
    if "restart_warm" in parts:
        proof.restart_warm()
    if names:
        proof.throughput(names)
    proof.targets()
    proof.record({"proof": "end", "seconds": round(time.time() - proof.started, 1)})


if __name__ == "__main__":
    main()

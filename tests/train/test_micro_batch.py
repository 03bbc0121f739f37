"""--micro-batch auto on the CPU, out-of-memory errors injected by a hook on the model: the probe's choice (forced to
run here, where it does not by itself) and that it leaves no trace, the regrouping of the loader's micro-batches, a
step redone in halves mid-run, validation in halves, the choice kept in the checkpoint and reused by a restart on the
same kind of device with the same settings, no larger than the run's share (and probed again on another), exact
kill-resume with a halved micro-batch, and the run's end, in one line, at a second out-of-memory error of a kind;
--decode gpu's decode running out of memory (a stand-in decoder's error): a step's out-of-memory error under auto,
one line without it."""

from __future__ import annotations

import contextlib
import copy
import io
import random
import re
from typing import Optional

import numpy as np
import pytest
import torch
from conftest import SMALL_RUN, assert_names, load_checkpoint
from inprocess import command, in_memory, train
from torch import nn

from imagenet_elastic.data.device import gpu_decode
from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.errors import UserError
from imagenet_elastic.models.compile import CompiledOrEager
from imagenet_elastic.train import build, memory_probe, micro_batch
from imagenet_elastic.train.micro_batch import OutOfMemoryAgain, fitting_plan, regroup
from imagenet_elastic.train.step import StepContext
from imagenet_elastic.train.trainer import Trainer

RUN = [*SMALL_RUN, "--workers", "0", "--threads", "1", "--epochs", "1", "--max-steps-per-epoch", "5",
       "--no-tensorboard"]
AUTO = [*RUN, "--micro-batch", "auto"]
SPLITS = in_memory()


class OutOfMemoryAbove:
    """The device's out-of-memory error from the model's classifier's forward (its BatchNorm layers, and its
    dropout, ran): for training batches larger than `train[step]`
    (the limit from that optimizer step on, counted from 0; -1: before the first step, the probe's), and for
    validation batches larger than `val`. Counts the forwards it saw, by batch size."""

    def __init__(self, train: Optional[dict[int, int]] = None, val: Optional[int] = None) -> None:
        self.train, self.val, self.at = train or {}, val, -1  # `at`: the step before a trainer counts them
        self.trainer: Optional[Trainer] = None
        self.seen: list[tuple[int, int, bool]] = []  # (step, batch size, training)

    @property
    def step(self) -> int:
        """The optimizer step being trained: the trainer's count once it trains, whichever way it calls the step."""
        return self.trainer.state.step if self.trainer is not None else self.at

    def install(self, monkeypatch) -> None:
        create = build.create_model

        def created(*args, **kwargs) -> nn.Module:
            model = create(*args, **kwargs)
            model.get_classifier().register_forward_pre_hook(self.forward)  # after every BatchNorm layer
            return model
        monkeypatch.setattr(build, "create_model", created)

    def limit(self) -> Optional[int]:
        due = [limit for step, limit in self.train.items() if step <= self.step]
        return due[-1] if due else None

    def forward(self, module: nn.Module, args: tuple) -> None:
        size = args[0].shape[0]
        self.seen.append((self.step, size, module.training))
        limit = self.limit() if module.training else self.val
        if limit is not None and size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} images (injected)")

    def count_steps(self, trainer: Trainer) -> None:
        """Tell the hook which optimizer step trains (a `before_fit` for inprocess.train)."""
        self.trainer = trainer


def run(tmp_path, name: str, argv: list[str], oom: Optional[OutOfMemoryAbove] = None, monkeypatch=None,
        signal_during_step: Optional[int] = None, resume: bool = False) -> dict:
    folder = tmp_path / name
    if oom is not None:
        oom.install(monkeypatch)
    train(["DATA", *argv, "--checkpoints-path", str(folder), *(["--resume"] if resume else [])],
          signal_during_step=signal_during_step, splits=SPLITS, before_fit=oom.count_steps if oom else None)
    if monkeypatch is not None:
        monkeypatch.undo()
    return load_checkpoint(folder / "last.pt")


def micro_batch_row(stdout: str) -> str:
    """The micro-batch row of the last start-up table in `stdout`: how many images a forward pass takes, and why."""
    rows = re.findall(r"^  micro-batch +(.*)$", stdout, re.MULTILINE)
    assert rows, stdout
    return rows[-1]


def probing_on_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(micro_batch, "probes", lambda device: True)


def assert_same_training(a: dict, b: dict, keys=("model", "optimizer", "scaler", "step", "epoch_progress")) -> None:
    for key in keys:
        assert_equal(a[key], b[key], key)


def assert_equal(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ----------------------------------------------------------------------------- the pieces


def numbered(n: int) -> Batch:
    return Batch(torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 2, 2, 3).contiguous(),
                 torch.arange(n), torch.arange(100, 100 + n))


@pytest.mark.parametrize("share,loader_micro,micro", [(13, 8, 4), (12, 5, 3), (16, 8, 8), (8, 8, 3)])
def test_regroup_cuts_the_loaders_micro_batches_where_the_smaller_plan_puts_them(share, loader_micro, micro):
    loader, wanted = BatchPlan(share, 1, loader_micro), BatchPlan(share, 1, micro)
    whole = numbered(share)
    given = [whole.part(part) for part in loader.micro_slices(0)]
    out = regroup(given, loader.micro_slices(0), wanted.micro_slices(0))
    assert len(out) == wanted.accum
    for batch, part in zip(out, wanted.micro_slices(0)):
        for field in ("images", "labels", "indices"):
            assert torch.equal(getattr(batch, field), getattr(whole, field)[part]), (field, part)
    assert regroup(given, loader.micro_slices(0), loader.micro_slices(0)) is given  # the same plan: as given


def test_a_smaller_plan_keeps_every_mixing_pair_in_one_micro_batch():
    assert fitting_plan(52, 1, 12, mixes=False).micro_batch == 12  # 11/11/10/10/10: odd sizes
    mixed = fitting_plan(52, 1, 12, mixes=True)
    assert mixed.micro_batch < 12 and all(p.start % 2 == 0 and p.stop % 2 == 0 for p in mixed.micro_slices(0))
    assert fitting_plan(6, 1, 1, mixes=True) is None  # no micro-batch of one image holds a pair


def test_the_probe_halves_from_the_first_size_until_one_fits():
    tried = []

    def fits(size: int) -> bool:
        tried.append(size)
        return size <= 5
    assert memory_probe.largest_that_fits(fits, 24, lambda s: s // 2 or None) == 3
    assert tried == [24, 12, 6, 3]
    assert memory_probe.largest_that_fits(lambda s: False, 4, lambda s: s // 2 or None) is None


def probe_model() -> tuple[nn.Module, ModelInput]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.3), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(6, 4))
    return model, ModelInput(torch.device("cpu"), None, False)


@pytest.mark.parametrize("optimizer", ["sgd, fresh", "sgd, stepped", "adamw, stepped"])
def test_the_probe_leaves_weights_statistics_optimizer_and_random_generators_as_they_were(optimizer):
    model, to = probe_model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer.startswith("sgd")
           else torch.optim.AdamW(model.parameters(), lr=0.1))
    if optimizer.endswith("stepped"):  # a resumed run's optimizer has a state
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()  # whatever mode it was left in
    oom = OutOfMemoryAbove({-1: 3})
    model[-1].register_forward_pre_hook(oom.forward)  # after BatchNorm and dropout
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state(),
              random.getstate(), np.random.get_state()[1].copy())
    found = memory_probe.probe(model, opt, nn.CrossEntropyLoss(), to, 8, 16, lambda s: s // 2 or None)
    assert found == 2 and [size for _, size, _ in oom.seen] == [16, 8, 4, 2, 2]  # two steps of the size that fits
    after = (model.state_dict(), opt.state_dict(), torch.get_rng_state(), random.getstate(), np.random.get_state()[1])
    assert_equal(before[0], after[0], "model")
    assert_equal(before[1], after[1], "optimizer")
    assert torch.equal(before[2], after[2]) and before[3] == after[3] and np.array_equal(before[4], after[4])
    assert all(p.grad is None for p in model.parameters()) and not any(m.training for m in model.modules())


def test_an_out_of_memory_error_in_a_first_compiled_call_is_no_compile_failure():
    model, _ = probe_model()
    oom = OutOfMemoryAbove({-1: 2})
    model.register_forward_pre_hook(oom.forward)
    compiled = CompiledOrEager(model, backend="eager")
    with pytest.raises(torch.OutOfMemoryError):
        compiled(torch.randn(4, 3, 8, 8))
    assert compiled.failure is None and not compiled.called  # the next call compiles
    assert compiled(torch.randn(2, 3, 8, 8)).shape == (2, 4) and compiled.failure is None


# ----------------------------------------------------------------------------- the choice at start

SETTINGS = {"model": "test_resnet", "blurpool": False, "batch_size": 8, "image_size": 32, "precision": "fp32",
            "channels_last": False, "grad_checkpointing": False, "opt": "sgd", "model_ema": False, "ddp": False}


def choose(loader: BatchPlan, saved: Optional[dict], settings: dict = SETTINGS) -> micro_batch.MicroBatches:
    """--micro-batch auto's choice on this CPU (nothing to probe), for rank 0 of `loader`."""
    def probe(first, smaller):
        raise AssertionError("no probe on a CPU")
    return micro_batch.choose(True, loader, 0, False, torch.device("cpu"), settings, saved, probe, print)


def saved_choice(size: int, settings: dict = SETTINGS) -> dict:
    """What a checkpoint made on this CPU keeps of the choice (MicroBatches.saved)."""
    return {"size": size, "device": "cpu", "memory": 0, "settings": dict(settings)}


@pytest.mark.parametrize("now", [{}, {"image_size": 48}, {"model_ema": True}, {"teacher": "0f" * 32}],
                         ids=["same settings", "another --image-size", "--model-ema", "a teacher"])
def test_a_saved_choice_is_reused_only_under_the_settings_it_was_made_with(now):
    micro = choose(BatchPlan(8, 1, 8), saved_choice(4), {**SETTINGS, **now})
    if now:  # probed again where it can be; on a CPU, --batch-size's
        assert micro.size == 8 and "--batch-size's" in micro.describe()
    else:
        assert micro.size == 4 and "the checkpoint's for this GPU (cpu)" in micro.describe()
    assert micro.saved()["micro_batch"]["settings"] == {**SETTINGS, **now}


def test_a_saved_choice_larger_than_this_runs_share_takes_the_share_and_halves_from_it():
    """Saved with micro-batches of 8, resumed with shares of 4 (another --global-batch-size or world size): 4, saved
    as 4, and an out-of-memory error halves to 2."""
    micro = choose(BatchPlan(4, 1, 4), saved_choice(8))
    assert micro.size == 4 and micro.saved()["micro_batch"]["size"] == 4
    model, to = probe_model()
    oom = OutOfMemoryAbove({0: 2})
    oom.at = 0
    model[-1].register_forward_pre_hook(oom.forward)
    ctx = StepContext(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False),
                      nn.CrossEntropyLoss(), to)
    batch = Batch(torch.randint(0, 256, (4, 8, 8, 3), dtype=torch.uint8), torch.tensor([0, 1, 2, 3]))
    micro.step(ctx, [batch], 0.1, 0, 0)
    assert micro.size == 2 and [size for _, size, _ in oom.seen] == [4, 2, 2]
    assert micro.saved()["micro_batch"]["size"] == 2


# ----------------------------------------------------------------------------- runs


def test_a_probe_that_finds_the_whole_batch_fits_changes_no_bit_of_the_run(tmp_path, monkeypatch):
    plain = run(tmp_path, "plain", RUN)
    probing_on_the_cpu(monkeypatch)
    oom = OutOfMemoryAbove()
    probed = run(tmp_path, "probed", AUTO, oom, monkeypatch)
    assert [size for step, size, training in oom.seen if step == -1 and training] == [8, 8]  # it probed
    assert_same_training(plain, probed, ("model", "optimizer", "scaler", "step", "epoch_progress", "rng"))
    assert probed["history"][0]["val_top1"] == plain["history"][0]["val_top1"]
    assert probed["micro_batch"]["size"] == 8


def test_the_probe_takes_the_largest_micro_batch_that_fits_and_trains_as_a_run_set_to_it(tmp_path, monkeypatch,
                                                                                          capsys):
    set_to_it = run(tmp_path, "set", [*RUN, "--batch-size", "4", "--global-batch-size", "8"])
    probing_on_the_cpu(monkeypatch)
    oom = OutOfMemoryAbove({-1: 5})
    probed = run(tmp_path, "probed", AUTO, oom, monkeypatch)
    assert [size for step, size, _ in oom.seen if step == -1] == [8, 4, 4]
    assert_same_training(set_to_it, probed)
    assert probed["micro_batch"] == {"size": 4, "device": "cpu", "memory": 0, "settings": probed["micro_batch"][
        "settings"]}
    assert {k: probed["micro_batch"]["settings"].get(k) for k in ("batch_size", "image_size", "model_ema", "teacher")} \
        == {"batch_size": 8, "image_size": 32, "model_ema": False, "teacher": None}  # what the choice holds for
    table = capsys.readouterr().out
    assert "8 = 1 process x 8, in 2 micro-batches of 4" in table
    assert_names(micro_batch_row(table), "auto", "4 images", "cpu", "probed")  # auto's choice: probed on this device


@pytest.fixture(scope="module")
def halved_mid_run(tmp_path_factory) -> tuple[dict, str]:
    """A run whose third step (step 2) runs out of memory with micro-batches of 8, and its warnings."""
    warnings = io.StringIO()
    with contextlib.redirect_stderr(warnings):
        state = run(tmp_path_factory.mktemp("halved"), "run", AUTO, OutOfMemoryAbove({2: 4}), pytest.MonkeyPatch())
    return state, warnings.getvalue()


def test_a_step_that_runs_out_of_memory_is_redone_in_halves_as_a_run_that_switched_there(tmp_path, halved_mid_run):
    halved, output = halved_mid_run
    before = run(tmp_path, "reference", RUN, signal_during_step=2)  # stops with a checkpoint after step 2
    assert before["step"] == 2
    switched = run(tmp_path, "reference", [*RUN, "--batch-size", "4", "--global-batch-size", "8"], resume=True)
    assert_same_training(switched, halved)
    assert halved["micro_batch"]["size"] == 4  # the restart takes the halved size
    said = [line for line in output.splitlines() if "out of memory" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), said  # once: the step, the size, torch's error, the half
    assert_names(said[0], "step 3", "micro-batches of 8", "(CUDA out of memory.", "micro-batches of 4")
    assert "every rank" not in said[0]  # one process


def test_a_run_stopped_after_halving_resumes_with_the_halved_micro_batch_exactly(tmp_path, monkeypatch, halved_mid_run,
                                                                                 capsys):
    stopped = run(tmp_path, "run", AUTO, OutOfMemoryAbove({2: 4}), monkeypatch, signal_during_step=4)
    assert stopped["step"] == 4 and stopped["micro_batch"]["size"] == 4
    capsys.readouterr()
    oom = OutOfMemoryAbove()  # the restart: no error, and it must not try micro-batches of 8 again
    resumed = run(tmp_path, "run", AUTO, oom, monkeypatch, resume=True)
    assert_same_training(resumed, halved_mid_run[0])
    assert {size for _, size, training in oom.seen if training} == {4}
    assert_names(micro_batch_row(capsys.readouterr().out), "auto", "4 images", "checkpoint", "(cpu)")  # not probed


def test_a_restart_on_another_kind_of_gpu_probes_again(tmp_path, monkeypatch, halved_mid_run, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save(halved_mid_run[0], folder / "last.pt")  # saved on the "cpu" with micro-batches of 4
    probing_on_the_cpu(monkeypatch)
    monkeypatch.setattr(micro_batch, "device_identity", lambda device: ("Other GPU", 80 * 2**30))
    oom = OutOfMemoryAbove()
    again = run(tmp_path, "run", [*AUTO, "--epochs", "2"], oom, monkeypatch, resume=True)
    assert [size for step, size, _ in oom.seen if step == -1] == [8, 8]  # probed from --batch-size, which fits
    assert again["micro_batch"]["size"] == 8 and again["micro_batch"]["device"] == "Other GPU"
    assert "the largest that fits Other GPU, 80.0 GiB (probed in" in capsys.readouterr().out


def test_validation_that_runs_out_of_memory_goes_on_in_halves(tmp_path, monkeypatch, capsys):
    plain = run(tmp_path, "plain", RUN)
    oom = OutOfMemoryAbove(val=5)
    halved = run(tmp_path, "halved", AUTO, oom, monkeypatch)
    assert_same_training(plain, halved)
    assert halved["history"][0]["val_top1"] == plain["history"][0]["val_top1"]
    assert halved["history"][0]["val_loss"] == pytest.approx(plain["history"][0]["val_loss"], rel=1e-6)
    assert [size for _, size, training in oom.seen if not training][:3] == [8, 4, 4]  # then 4s, and the last 4 of 36
    said = [line for line in capsys.readouterr().err.splitlines() if "out of memory" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), said  # once: the rank, the batch, the error, the half
    assert_names(said[0], "rank 0", "validating", "batch of 8", "(CUDA out of memory. Tried to allocate 8 images "
                 "(injected))", "batches of 4")


def test_a_second_out_of_memory_error_of_a_kind_ends_the_run_in_one_line(tmp_path, monkeypatch):
    oom = OutOfMemoryAbove({1: 4, 3: 2})
    with pytest.raises(OutOfMemoryAgain) as caught:
        run(tmp_path, "run", AUTO, oom, monkeypatch)
    assert_names(str(caught.value), "out of memory again", "step 4", "micro-batches of 4", "halved once already",
                 "CUDA out of memory")


@pytest.mark.parametrize("kind", ["training", "validation"])
def test_without_auto_an_out_of_memory_error_ends_the_run_as_before(tmp_path, monkeypatch, kind):
    oom = OutOfMemoryAbove({1: 4}) if kind == "training" else OutOfMemoryAbove(val=4)
    with pytest.raises(torch.OutOfMemoryError):
        run(tmp_path, "run", RUN, oom, monkeypatch)


def test_a_device_that_fits_no_micro_batch_stops_the_run_in_one_line_before_the_first_step(tmp_path, monkeypatch):
    probing_on_the_cpu(monkeypatch)
    oom = OutOfMemoryAbove({-1: 0})
    with pytest.raises(UserError) as caught:
        run(tmp_path, "run", [*AUTO, "--mixup-alpha", "0.2"], oom, monkeypatch)
    assert_names(str(caught.value), "--micro-batch auto", "32 px", "test_resnet", "cpu")
    assert [size for _, size, _ in oom.seen] == [8, 4, 2]  # mixing's pairs: no micro-batch of one


# ----------------------------------------------------------------------------- --decode gpu out of memory

DECODE_GPU = ["--decode", "gpu", "--gpu-decoder", "torchvision"]  # on the CPU's tensors here


class DecodeRunsOutOfMemory:
    """--decode gpu's decoder (gpu_decode.BatchDecoder's device decode) raising the device's out-of-memory error at
    the calls numbered `failing` (from 0: the training batches in order, then validation's)."""

    def __init__(self, *failing: int) -> None:
        self.failing, self.calls = set(failing), 0

    def install(self, monkeypatch) -> None:
        decode = gpu_decode.BatchDecoder.decode_on_device

        def decode_on_device(decoder, images):
            self.calls += 1
            if self.calls - 1 in self.failing:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to decode {len(images)} images (injected)")
            return decode(decoder, images)
        monkeypatch.setattr(gpu_decode.BatchDecoder, "decode_on_device", decode_on_device)


@pytest.mark.parametrize("workers", ["1", "0"])  # decoded by a thread of its own; by the training thread
def test_a_decode_out_of_memory_under_auto_halves_that_step_as_its_own_error_would_and_decodes_the_batch_again(
        tmp_path, monkeypatch, capsys, workers):
    argv = [*AUTO, *DECODE_GPU, "--workers", workers]
    step_failed = run(tmp_path, "step", argv, OutOfMemoryAbove({2: 4}), monkeypatch)  # the third step's own error
    capsys.readouterr()
    decode = DecodeRunsOutOfMemory(2)  # the third step's batch
    decode.install(monkeypatch)
    decode_failed = run(tmp_path, "decode", argv)
    monkeypatch.undo()
    assert_same_training(decode_failed, step_failed)  # no sample lost or repeated, the step redone in halves
    assert decode_failed["micro_batch"]["size"] == 4
    assert decode_failed["history"][0]["val_samples"] == step_failed["history"][0]["val_samples"]
    said = [line for line in capsys.readouterr().err.splitlines() if "out of memory" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), said  # once: decoding which batch, the error, the half
    assert_names(said[0], "rank 0", "decoding", "8 images", "step 3", "(CUDA out of memory. Tried to decode 8 images "
                 "(injected))", "micro-batches of 4")


def test_a_validation_decode_out_of_memory_under_auto_halves_validations_batches_and_scores_every_image(
        tmp_path, monkeypatch, capsys):
    argv = [*AUTO, *DECODE_GPU, "--workers", "0"]  # decoded in the training thread: calls in the loaders' order
    plain = run(tmp_path, "plain", argv)
    capsys.readouterr()
    DecodeRunsOutOfMemory(5).install(monkeypatch)  # the five training batches, then validation's first
    failed = run(tmp_path, "failed", argv)
    monkeypatch.undo()
    assert_same_training(failed, plain)
    assert failed["history"][0]["val_top1"] == plain["history"][0]["val_top1"]
    assert failed["history"][0]["val_samples"] == plain["history"][0]["val_samples"] == 36
    said = [line for line in capsys.readouterr().err.splitlines() if "out of memory" in line]
    assert len(said) == 1 and said[0].startswith("warning: "), said  # once: decoding which batch, the error, the half
    assert_names(said[0], "rank 0", "decoding", "8 images", "validation", "(CUDA out of memory. Tried to decode 8 "
                 "images (injected))", "batches of 4")


def test_a_batch_whose_decode_runs_out_of_memory_again_alone_ends_the_run_in_one_line(tmp_path, monkeypatch):
    DecodeRunsOutOfMemory(2, 3).install(monkeypatch)  # the third step's batch, and its second decode
    with pytest.raises(OutOfMemoryAgain) as caught:
        run(tmp_path, "run", [*AUTO, *DECODE_GPU, "--workers", "1"])
    assert_names(str(caught.value), "out of memory again decoding", "8 images", "step 3", "CUDA out of memory",
                 "--batch-size", "--decode cpu")


def test_without_auto_a_decode_out_of_memory_ends_the_run_in_one_line_naming_what_to_change(image_folder, tmp_path,
                                                                                              monkeypatch):
    DecodeRunsOutOfMemory(2).install(monkeypatch)
    result = command([str(image_folder), *RUN, *DECODE_GPU, "--workers", "1", "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("imagenet-elastic: error: "), result.stderr
    # decoding which batch, for which step, on --decode gpu, torch's error; then the three remedies' flags
    assert_names(errors[0], "decoding", "8 images", "step 3", "--decode gpu", "CUDA out of memory. Tried to decode 8 "
                 "images (injected)", "--batch-size", "--micro-batch auto", "--decode cpu")

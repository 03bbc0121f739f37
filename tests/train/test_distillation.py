"""--teacher: timm's distillation losses against a hand computation; the teacher frozen and fed the student's batch in
its own preprocessing; its identity checked at resume; a kill mid-epoch resumes bitwise with a teacher; a distilled
student validates on the average of its two heads. In this process (tests/inprocess.py), on the tests' small data."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, SMALL_RUN, assert_names, assert_same_tensors, child_env, load_checkpoint, torchrun_cmd
from inprocess import command, train
from makers import cached, timm_model

from imagenet_elastic.data.model_input import IMAGENET_MEAN, IMAGENET_STD, ModelInput, prepare_batch
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.errors import UserError
from imagenet_elastic.models import teacher_weights
from imagenet_elastic.models.create import create_model
from imagenet_elastic.models.teacher_weights import TeacherInput, TeacherWeights
from imagenet_elastic.models.weights import CHECKPOINT, EXPORT, PUBLISHED, exported_class_names
from imagenet_elastic.report.samplelog import ENV_VAR, coverage
from imagenet_elastic.train.distillation import HARD, LOGIT, SOFT, Distillation, Teacher, loss_weights
from imagenet_elastic.train.state import EpochTally, PendingSteps
from imagenet_elastic.train.step import evaluate

CPU = torch.device("cpu")
QUICK = ["--workers", "0", "--threads", "1"]


def run_args(image_folder: Path, folder: Path, *extra: str, epochs: int = 1, steps: int = 2,
             here: bool = True) -> list[str]:
    """A short run; `here`: in this process (no loader worker, one thread), else as a process runs it."""
    return [str(image_folder), *SMALL_RUN, *(QUICK if here else []), "--epochs", str(epochs),
            "--max-steps-per-epoch", str(steps), "--checkpoints-path", str(folder), *extra]


@pytest.fixture(scope="module")
def teachers(image_folder, tmp_path_factory) -> dict[str, Path]:
    """Three teachers of two steps each: `a`, `b` (another seed: other weights) and `wide` (trained and validated at
    48 px: the student's 32 px batch is resized for it)."""
    root = tmp_path_factory.mktemp("teachers")
    found = {}
    for name, extra in (("a", []), ("b", ["--seed", "1"]), ("wide", ["--image-size", "48"])):
        outcome = train(run_args(image_folder, root / name, *extra))
        assert outcome.final_step == 2
        found[name] = root / name / "last.pt"
    return found


# ----------------------------------------------------------------------------- the losses, by hand


def softmax(row: list[float], t: float) -> list[float]:
    exps = [math.exp(v / t) for v in row]
    return [e / sum(exps) for e in exps]


def kl_by_hand(student: torch.Tensor, teacher: torch.Tensor, t: float) -> float:
    """sum_i p_t(i) log(p_t(i) / p_s(i)) per row, the rows' mean, x t^2: Hinton's soft targets, written out."""
    total = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist()):
        p_s, p_t = softmax(s_row, t), softmax(t_row, t)
        total += sum(pt * math.log(pt / ps) for pt, ps in zip(p_t, p_s))
    return total / len(student) * t * t


def cross_entropy_by_hand(logits: torch.Tensor, classes: list[int]) -> float:
    return sum(-math.log(softmax(row, 1.0)[c]) for row, c in zip(logits.tolist(), classes)) / len(classes)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.1, 0.2, 3.0, -2.0], [-1.0, 1.5, 0.0, 0.3]])
DIST_HEAD = torch.tensor([[0.5, 0.5, -1.0, 2.0], [1.0, -1.0, 0.0, 0.0], [0.0, 2.0, 1.0, -0.5]])
TEACHER = torch.tensor([[3.0, 0.0, 1.0, -1.0], [0.0, 0.0, 2.5, 0.5], [-2.0, 0.5, 1.0, 0.0]])  # top classes 0, 2, 2
LABELS = torch.tensor([0, 2, 3])


def distil(kind: str, outputs, task_weight: float, distill_weight: float, temperature: float = 2.0):
    distillation = Distillation(lambda images: TEACHER, kind, temperature, task_weight, distill_weight)
    return distillation(outputs, LABELS, torch.zeros(3, 3, 8, 8), torch.nn.CrossEntropyLoss())


def test_logit_distillation_is_the_kl_of_the_softened_distributions_times_t_squared_beside_the_task_loss():
    loss, parts = distil(LOGIT, LOGITS, 0.3, 0.7)
    task, kd = cross_entropy_by_hand(LOGITS, [0, 2, 3]), kl_by_hand(LOGITS, TEACHER, 2.0)
    assert parts.tolist() == pytest.approx([0.3 * task + 0.7 * kd, task, kd], rel=1e-5)
    assert loss.item() == pytest.approx(0.3 * task + 0.7 * kd, rel=1e-5) and loss.requires_grad is False  # no params
    assert parts.dtype == torch.float32 and not parts.requires_grad


def test_token_distillation_teaches_the_distillation_head_and_the_class_head_learns_the_labels():
    _, soft = distil(SOFT, (LOGITS, DIST_HEAD), 1.0, 1.0, temperature=3.0)
    task = cross_entropy_by_hand(LOGITS, [0, 2, 3])
    assert soft.tolist() == pytest.approx([task + kl_by_hand(DIST_HEAD, TEACHER, 3.0), task,
                                           kl_by_hand(DIST_HEAD, TEACHER, 3.0)], rel=1e-5)
    _, hard = distil(HARD, (LOGITS, DIST_HEAD), 0.5, 0.5, temperature=3.0)  # DeiT's: the temperature plays no part
    taught = cross_entropy_by_hand(DIST_HEAD, [0, 2, 2])  # the teacher's top classes, not the labels
    assert hard.tolist() == pytest.approx([0.5 * task + 0.5 * taught, task, taught], rel=1e-5)


def test_the_loss_weights_follow_timms_three_cases():
    assert loss_weights(None, None) == (1.0, 1.0)
    assert loss_weights(0.25, None) == (0.25, 0.75)  # the task's alone: the distillation takes the rest
    assert loss_weights(None, 2.0) == (1.0, 2.0)
    assert loss_weights(0.5, 3.0) == (0.5, 3.0)


def test_pending_steps_fold_the_parts_of_the_loss_with_the_loss_in_one_reduction(monkeypatch):
    from imagenet_elastic.launch import distributed

    sent = []
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda t: sent.append(t.clone()) or t * 2)  # 2 equal ranks
    pending, tally = PendingSteps(CPU, ("task_loss", "distill_loss")), EpochTally()
    for step in ([3.0, 1.0, 2.0], [5.0, 2.0, 3.0]):
        pending.add(torch.tensor(step))
    added = pending.fold_into(tally, global_batch=16, world_size=2)
    assert len(sent) == 1 and added.loss_sum == 8.0 and added.parts == {"task_loss": 3.0, "distill_loss": 5.0}
    assert tally.parts == {"task_loss": 3.0, "distill_loss": 5.0}


# ----------------------------------------------------------------------------- the teacher's input


class Recording(torch.nn.Module):
    """A teacher that keeps what it was given and answers 4 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.seen: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.seen.append(images.clone())
        return images.mean(dim=(2, 3)).repeat(1, 2)[:, :4] * self.weight


def recording_teacher(size: tuple[int, int], mean, std, channels_last: bool = True) -> tuple[Teacher, Recording]:
    model = Recording()
    weights = TeacherWeights(model, CHECKPOINT, "", "", None, None, None, spec="recording",
                             input=TeacherInput(size, mean, std), sha256="0" * 64)
    return Teacher(weights, ModelInput(CPU, None, channels_last)), model


def student_batch(channels_last: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images, _ = prepare_batch(pixels, torch.zeros(2, dtype=torch.int64), ModelInput(CPU, None, channels_last))
    return pixels, images


def test_a_teacher_with_another_input_size_mean_and_std_gets_the_batch_resized_and_renormalised_for_it():
    mean, std = (127.5, 127.5, 127.5), (63.75, 127.5, 31.875)  # timm's Inception normalisation, scaled per channel
    teacher, model = recording_teacher((24, 40), mean, std)  # fewer rows: antialiasing matters
    pixels, images = student_batch()
    teacher(images)
    seen = model.seen[0]
    own = (pixels.permute(0, 3, 1, 2).double() - torch.tensor(mean).view(1, 3, 1, 1).double()) \
        / torch.tensor(std).view(1, 3, 1, 1).double()  # the teacher's own normalisation of the same pixels
    wanted = F.interpolate(own, size=(24, 40), mode="bilinear", antialias=True, align_corners=False)
    assert seen.shape == (2, 3, 24, 40) and seen.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(seen.double(), wanted, rtol=0, atol=2e-5)


def test_a_teacher_with_the_students_preprocessing_sees_the_students_very_batch():
    teacher, model = recording_teacher((32, 32), IMAGENET_MEAN, IMAGENET_STD)
    _, images = student_batch()
    teacher(images)
    assert torch.equal(model.seen[0], images)


def test_the_teacher_runs_without_gradients_in_eval_mode():
    teacher, model = recording_teacher((32, 32), IMAGENET_MEAN, IMAGENET_STD)
    _, images = student_batch()
    out = teacher(images.requires_grad_())
    assert not out.requires_grad and not model.training and not model.weight.requires_grad


# ----------------------------------------------------------------------------- runs with a teacher


def test_the_teacher_stays_frozen_and_unchanged_by_training_and_the_rows_carry_the_distillation_loss(
        image_folder, tmp_path, teachers):
    """The teacher's BatchNorm statistics move if it runs in train mode, and its weights if an optimizer holds them."""
    seen = {}

    def keep(trainer) -> None:
        seen["teacher"] = trainer.ctx.distillation.teacher.model
        seen["before"] = {k: v.clone() for k, v in seen["teacher"].state_dict().items()}

    train(run_args(image_folder, tmp_path, "--teacher", str(teachers["a"]), "--mixup-alpha", "0.4", "--lr", "4"),
          before_fit=keep)
    model = seen["teacher"]
    assert not model.training and all(not m.training for m in model.modules())
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    assert_same_tensors(model.state_dict(), seen["before"])
    assert_same_tensors(model.state_dict(), load_checkpoint(teachers["a"])["model"])
    saved = load_checkpoint(tmp_path / "last.pt")
    assert not any(k.startswith("teacher") for k in saved["model"])  # its weights are nowhere in the checkpoint
    assert saved["teacher"]["spec"] == str(teachers["a"]) and len(saved["teacher"]["sha256"]) == 64
    row = saved["history"][-1]
    assert row["train_loss"] == pytest.approx(row["train_task_loss"] + row["train_distill_loss"], rel=1e-6)
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert all({"loss", "task_loss", "distill_loss"} <= set(s) for s in steps)


def test_a_resume_with_another_teacher_is_refused_in_one_line_and_the_same_one_continues(
        image_folder, tmp_path, teachers):
    first = run_args(image_folder, tmp_path, "--teacher", str(teachers["a"]))
    train(first)
    other = command([*run_args(image_folder, tmp_path, "--teacher", str(teachers["b"]), epochs=2), "--resume"])
    assert other.returncode != 0 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert str(teachers["a"]) in other.stderr and str(teachers["b"]) in other.stderr
    assert "resume with the same teacher" in other.stderr
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 2  # nothing touched
    same = train([*run_args(image_folder, tmp_path, "--teacher", str(teachers["a"]), epochs=2), "--resume"])
    assert same.final_step == 4


def test_a_teacher_added_or_dropped_at_resume_is_a_warning_and_another_input_a_refusal():
    """Only another teacher is refused; a teacher added or dropped changes the loss, as other settings do (warned)."""
    mine = TeacherWeights(Recording(), CHECKPOINT, "t.pt", "", None, None, None, spec="t.pt",
                          input=TeacherInput((32, 32), IMAGENET_MEAN, IMAGENET_STD), sha256="a" * 64)
    assert teacher_weights.compare(None, None, "last.pt") is None
    assert teacher_weights.compare(mine.identity(), mine, "last.pt") is None
    moved = dict(mine.identity(), spec="/elsewhere/t.pt")  # the same weights and input under another path
    assert teacher_weights.compare(moved, mine, "last.pt") is None
    assert teacher_weights.compare(None, mine, "last.pt") == "teacher: checkpoint none, now t.pt"
    assert teacher_weights.compare(mine.identity(), None, "last.pt") == "teacher: checkpoint t.pt, now none"
    resized = dict(mine.identity(), input=dict(mine.input.saved(), size=[48, 48]))
    with pytest.raises(UserError, match="distilled from --teacher t.pt .* another input"):
        teacher_weights.compare(resized, mine, "last.pt")


def test_a_teacher_given_as_its_export_folder_is_the_same_teacher(image_folder, tmp_path, teachers):
    """The export of a checkpoint holds the same weights and preprocessing: the same identity, so a run distilled from
    the checkpoint resumes from the folder."""
    from imagenet_elastic.tools.export import export

    export(str(teachers["a"]), str(tmp_path / "export"), ema=False)
    from_checkpoint, from_folder = teacher_weights.read(str(teachers["a"])), teacher_weights.read(
        str(tmp_path / "export"))
    assert from_folder.kind == EXPORT and from_folder.identity()["sha256"] == from_checkpoint.sha256
    assert from_folder.input == from_checkpoint.input
    train(run_args(image_folder, tmp_path / "run", "--teacher", str(teachers["a"])))
    resumed = train([*run_args(image_folder, tmp_path / "run", "--teacher", str(tmp_path / "export"), epochs=2),
                     "--resume"])
    assert resumed.final_step == 4


def test_a_published_teacher_comes_from_the_hub_cache_offline_and_sees_the_batch_in_its_own_preprocessing(
        hub, image_folder, tmp_path):
    """timm's test_resnet normalises with mean and std 0.5 and takes 160 px: the student's 32 px batch is
    renormalised and resized for it, as the start-up table says."""
    published = cached(hub, "someone/teacher", timm_model("test_resnet", 4, seed=5))
    weights = teacher_weights.read("hf-hub:someone/teacher")
    assert weights.kind == PUBLISHED and weights.classes == 4
    assert weights.input == TeacherInput((160, 160), (127.5,) * 3, (127.5,) * 3)
    assert_same_tensors(weights.model.state_dict(), published)
    result = command(run_args(image_folder, tmp_path, "--teacher", "hf-hub:someone/teacher", steps=1))
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("teacher "))
    assert f"sha256 {weights.sha256[:12]}" in row and "input 160 px, mean 0.500/0.500/0.500" in row
    assert "the student's batch renormalised and resized on the device" in row
    assert_names(row, "logit", "KL", "T=4", "1 x task", "1 x distillation")  # the kind, its loss, the weights


KILLED = {"logit": ["--mixup-alpha", "0.4", "--cutmix-alpha", "1.0", "--drop-path", "0.1"],
          "token": ["--model", "test_vit_distilled", "--lr", "0.5", "--opt", "adamw", "--kd-token-distill-type", "hard",
                    "--cutmix-alpha", "1.0", "--task-loss-weight", "0.4"]}


@pytest.mark.parametrize("kind", list(KILLED))
def test_a_run_with_a_teacher_stopped_mid_epoch_resumes_bitwise(image_folder, tmp_path, teachers, kind):
    """With a teacher that sees the batch resized (48 px for the student's 32), mixed batches, and drop path."""
    def args(folder: Path, *extra: str) -> list[str]:
        return run_args(image_folder, folder, "--teacher", str(teachers["wide"]), *KILLED[kind], *extra, epochs=2,
                        steps=3)

    straight = train(args(tmp_path / "straight"))
    stopped = train(args(tmp_path / "killed"), signal_during_step=2)
    assert stopped.stopped and stopped.saved_at_steps[-1] == 2
    resumed = train(args(tmp_path / "killed", "--resume"))
    assert straight.final_step == resumed.final_step == 6
    final, reference = load_checkpoint(tmp_path / "killed" / "last.pt"), load_checkpoint(tmp_path / "straight" /
                                                                                          "last.pt")
    assert_same_tensors(final["model"], reference["model"])
    assert_same_tensors(final["optimizer"]["state"], reference["optimizer"]["state"])
    assert [r["train_distill_loss"] for r in final["history"]] == [r["train_distill_loss"] for r in
                                                                    reference["history"]]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.usefixtures("warm_ranks")  # the ranks torchrun starts: forks of the warm python
def test_a_run_with_a_teacher_stopped_at_world_size_1_goes_on_under_torchrun_at_world_size_2(
        image_folder, tmp_path, teachers, monkeypatch):
    """Each rank holds its own teacher, outside DDP: the token-distilled student (both heads in every step) resumes
    at another world size with the same global batch, the same teacher, and each sample once."""
    def args(here: bool) -> list[str]:
        return run_args(image_folder, tmp_path / "ckpt", "--teacher", str(teachers["wide"]), *KILLED["token"],
                        "--global-batch-size", "16", epochs=2, steps=3, here=here)

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "samples"))
    assert train(args(here=True), signal_during_step=2).stopped
    result = subprocess.run(torchrun_cmd(2, *args(here=False), "--resume"), cwd=REPO, capture_output=True, text=True,
                            env=child_env(**{ENV_VAR: str(tmp_path / "samples")}), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "train loss" in result.stdout and "distillation" in result.stdout
    final = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert (final["world_size"], final["step"]) == (2, 6)
    assert final["teacher"]["sha256"] == teacher_weights.read(str(teachers["wide"])).sha256
    report = coverage(str(tmp_path / "samples"), 3 * 16, 16)
    assert (report.samples_lost, report.samples_repeated, report.world_sizes) == (0, 0, (1, 2)), report


# ----------------------------------------------------------------------------- a distilled student's validation


def test_a_distilled_student_trains_two_heads_and_validates_on_their_average():
    torch.manual_seed(0)
    model = create_model("test_vit_distilled", 4)
    model.set_distilled_training(True)
    to = ModelInput(CPU, None, channels_last=False)
    pixels = torch.randint(0, 256, (6, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    images, _ = prepare_batch(pixels, labels, to)
    model.train()
    assert isinstance(model(images), tuple)  # training: the class head's logits and the distillation head's
    model.eval()
    with torch.no_grad():
        tokens = model.forward_features(images)
        cls, dist = model.head(tokens[:, 0]), model.head_dist(tokens[:, 1])
    averaged = (cls + dist) / 2
    model.train()  # as training leaves it: validation puts it in eval mode itself
    result = evaluate(to, model, [Batch(pixels, labels)])
    assert result.loss == pytest.approx(F.cross_entropy(averaged, labels).item(), rel=1e-5)
    assert result.top1 == pytest.approx(100 * (averaged.argmax(1) == labels).float().mean().item())
    assert F.cross_entropy(cls, labels).item() != pytest.approx(result.loss, rel=1e-3)  # not the class head alone


# ----------------------------------------------------------------------------- one line for a teacher that cannot be


@pytest.mark.parametrize("extra,message", [
    (["--teacher", "missing.pt"], "--teacher: checkpoint missing.pt does not exist"),
    (["--teacher", "a", "--kd-token-distill-type", "hard"], "--kd-token-distill-type hard: timm's test_resnet has no "
                                                            "distillation head"),
    (["--distill-loss-weight", "0.5"], "--distill-loss-weight weighs a distillation loss: it needs --teacher"),
    (["--teacher", "a", "--task-loss-weight", "1.5"], "set --distill-loss-weight too"),
])
def test_a_teacher_that_cannot_be_used_is_one_line(image_folder, tmp_path, teachers, extra, message):
    extra = [str(teachers["a"]) if word == "a" else word for word in extra]
    result = command(run_args(image_folder, tmp_path / "run", *extra))
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_checkpoints_folder_as_teacher_is_its_best_checkpoint(teachers):
    folder = teachers["a"].parent
    teacher = teacher_weights.read(str(folder))
    assert (teacher.kind, teacher.spec) == (CHECKPOINT, str(folder))
    assert teacher.sha256 == teacher_weights.read(str(folder / "best.pt")).sha256
    assert teacher.source.endswith(f"({folder / 'best.pt'})")


@pytest.mark.parametrize("made,said", [
    ("nope_dir", "nope_dir: no such file or folder, and no model timm knows by that name"),
    ("runs/nope", "runs/nope: no such file or folder"),
    ("empty folder", ": a folder with neither config.json (an export: imagenet-elastic export) nor best.pt"),
])
def test_a_teacher_that_is_no_file_folder_or_timm_name_says_what_was_tried(tmp_path, monkeypatch, made, said):
    monkeypatch.chdir(tmp_path)
    spec = made
    if made == "empty folder":
        spec = str(tmp_path / "checkpoints")
        (tmp_path / "checkpoints").mkdir()
    with pytest.raises(UserError) as caught:
        teacher_weights.read(spec)
    assert str(caught.value).startswith(f"--teacher {spec}") and said in str(caught.value)
    assert "local-dir:" not in str(caught.value) and "Unknown model" not in str(caught.value)


def test_a_teacher_of_another_class_count_is_one_line(tmp_path, teachers):
    from conftest import make_image_folder

    data = make_image_folder(tmp_path / "five", classes=5, train_per_class=2, val_per_class=1)
    result = command(run_args(data, tmp_path / "run", "--teacher", str(teachers["a"])))
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "predicts 4 classes, the data has 5" in result.stderr


@pytest.mark.parametrize("form", ["checkpoint", "export"])
def test_a_teacher_trained_on_other_class_names_of_the_same_count_is_one_line(image_folder, tmp_path, teachers,
                                                                              form):
    """The same four classes in number, one renamed: output k of the teacher no longer means the data's class k,
    whether the teacher is the checkpoint or its export (config.json's label_names)."""
    import shutil

    from imagenet_elastic.tools.export import export

    data = tmp_path / "data"
    shutil.copytree(image_folder, data)
    first = sorted(p.name for p in (data / "train").iterdir())[1]
    for split in ("train", "val"):
        (data / split / first).rename(data / split / "renamed")  # still sorted last: class 1 onwards shift
    teacher = teachers["a"]
    if form == "export":
        teacher = tmp_path / "export"
        export(str(teachers["a"]), str(teacher), ema=False)
    result = command(run_args(data, tmp_path / "run", "--teacher", str(teacher)))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"--teacher {teacher} was trained on other class names" in result.stderr
    assert f"its class 1 is {first!r}" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config,names", [
    ({"label_names": ["a", "b"]}, ("a", "b")),
    ({"label_names": {"1": "b", "0": "a"}}, ("a", "b")),  # timm's other form: output index to name
    ({"label_names": {"0": "a", "2": "b"}}, None),  # a gap: which output is which is not said
    ({"num_classes": 2}, None),
])
def test_an_exports_class_names_are_read_from_its_label_names_in_either_of_timms_forms(config, names):
    assert exported_class_names(config) == names

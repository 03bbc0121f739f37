"""Command line to frozen Config (the parser is built from Config's fields), and the process exit."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, Optional

from imagenet_elastic.config import (
    LAST_FILE,
    RESUME_AUTO,
    Config,
    add_setting,
    no_checkpoint,
    saved_setting,
)
from imagenet_elastic.config.yaml_file import file_value, named_by_file, read_settings, settings_yaml
from imagenet_elastic.errors import INTERRUPTED_EXIT, PROG, UserError, report
from imagenet_elastic.launch.launchers import RESTART_COUNTS
from imagenet_elastic.options import GROUPS, HelpFormatter, Parser, non_negative_int


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="Train an ImageNet classifier with DDP; survives restarts.",
               formatter_class=HelpFormatter,
               epilog="other commands (each has its own --help):\n" + "\n".join(
                   f"  {PROG} {name:<10} {what}" for name, (_, what) in SUBCOMMANDS.items()))
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    for f in dataclasses.fields(Config):
        meta = f.metadata
        if meta.get("positional"):  # optional here: it may come from --config (see parse)
            p.add_argument(f.name, metavar=meta["metavar"], help=meta["help"], nargs="?")
            continue
        add_setting(groups[meta["group"]], f.name)
    files = p.add_argument_group("settings files")
    files.add_argument("--config", metavar="FILE.yaml", help="read settings from a flat YAML file of option names "
                       "and values (`batch-size: 128`); options given on the command line override it")
    files.add_argument("--print-config", action="store_true",
                       help="print the resolved settings as YAML, in the form --config reads, and exit")
    p.add_argument("--local-rank", "--local_rank", dest="local_rank", type=non_negative_int, default=None,
                   help=argparse.SUPPRESS)  # passed by python -m torch.distributed.launch; not a setting
    return p


NOT_SETTINGS = ("local_rank", "config", "print_config", "file_only")


def resume_takes_a_path(argv: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """`--resume` takes the next word only when it names a checkpoint (a file, a `.pt` path, or a folder holding
    last.pt), else the word stays (argparse would take `--resume /data/imagenet`'s data folder for the checkpoint).
    Also returns the word a bare `--resume` left, if any: with a word too many, it was meant as the checkpoint."""
    out, words, left = [], list(argv), None
    for i, word in enumerate(words):
        if word == "--":
            return out + words[i:], left
        if word == "--resume":
            following = words[i + 1] if i + 1 < len(words) else "-"  # none: as if a flag followed
            path = not following.startswith("-") and (following.endswith(".pt") or os.path.isfile(following)
                                                      or os.path.isfile(os.path.join(following, LAST_FILE)))
            out.append("--resume" if path else f"--resume={RESUME_AUTO}")
            if not path and not following.startswith("-"):
                left = following
            continue
        out.append(word)
    return out, left


def parse(argv: Sequence[str]) -> tuple[Config, argparse.Namespace]:
    """The command line over the --config file over the defaults (for --evaluate, over FROM_CHECKPOINT's values), as
    a checked Config. `--resume FOLDER` makes FOLDER the checkpoints path too, unless one is given."""
    argv, left = resume_takes_a_path(argv)
    parser = build_parser()
    path = config_file(argv)
    from_file = read_settings(path, build_parser()) if path else {}  # the file's values become the parser's defaults
    parser.set_defaults(**from_file)
    args, extra = parser.parse_known_args(argv)
    read_as = None  # what the word a bare --resume left was read as, where it was surely meant as the checkpoint
    if extra and left is not None and left in (args.data, *extra):  # `--resume WORD DATA`
        read_as = "a second DATA beside " + " ".join(word for word in (args.data, *extra) if word != left)
    elif left is not None and args.data == left and from_file.get("data") not in (None, left):  # DATA from the file
        read_as = (f"DATA, over {path}'s data {from_file['data']} (a DATA meant to replace it goes before "
                   "--resume)")
    if read_as is not None:
        raise UserError(f"--resume {left}: {no_checkpoint(left)}, so it was read as {read_as}; --resume takes a "
                        f"checkpoint file, a folder holding {LAST_FILE} or, bare, CHECKPOINTS/{LAST_FILE}")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.data is None and not args.print_config:
        parser.error("the following arguments are required: DATA")
    probe = build_parser()  # which settings the command line gives: a second parse, with marker defaults
    probe.set_defaults(**dict.fromkeys(vars(args), _UNSET))
    on_line = {name for name, value in vars(probe.parse_args(argv)).items() if value is not _UNSET}
    args.file_only = {name: value for name, value in from_file.items()  # a null is no setting: the default's
                      if name not in on_line and file_value(name, value) is not None}
    given = on_line | set(from_file)
    try:
        config = config_from_args(args)
        named = config.resume not in (None, RESUME_AUTO)  # `--resume PATH`
        if named and config.resume == from_file.get("resume") and not args.print_config:
            check_resume(config)
        if named and os.path.isdir(config.resume) and "checkpoints_path" not in given:
            config = dataclasses.replace(config, checkpoints_path=config.resume)
        if config.evaluate:
            config = settings_from_checkpoint(config, [name for name in FROM_CHECKPOINT if name not in given])
    except UserError as error:
        raise named_by_file(error, path, args.file_only) from None
    return config, args


def config_file(argv: Sequence[str]) -> Optional[str]:
    """The --config file `argv` names, if any. Files are not merged: a second --config is refused, not the last
    taken silently, and so is an empty one (a script's unset variable), not read as none."""
    first = Parser(prog=PROG, add_help=False)
    first.add_argument("--config", action="append", default=[])
    paths = first.parse_known_args(argv)[0].config
    if len(paths) > 1:
        raise UserError(f"--config given twice ({paths[0]} and {paths[1]}): pass one settings file, and the "
                        "settings that differ from it as options")
    if paths == [""]:
        raise UserError("--config is empty: give it a path, or leave it out")
    return paths[0] if paths else None


def check_resume(config: Config) -> None:
    """The run's own choice of checkpoint (store.resume_path, which comes after the data scan), made now: a
    --resume PATH naming no checkpoint is refused unless a restart continues from CHECKPOINTS/last.pt instead."""
    from imagenet_elastic.checkpoint.store import CheckpointFolder

    restarted = any(os.environ.get(name, "0") not in ("", "0") for name in RESTART_COUNTS)
    CheckpointFolder(config.checkpoints_path, 0).resume_path(config.resume, restarted)


# What --evaluate takes from its checkpoint unless given: what its weights are (--pretrained, without which an
# `hf-hub:...` model is refused) and how its run validated them.
FROM_CHECKPOINT = ("model", "pretrained", "blurpool", "image_size", "val_crop_size", "val_resize")
_UNSET = object()


def settings_from_checkpoint(config: Config, names: Sequence[str]) -> Config:
    """--evaluate's settings `names` as its checkpoint's run had them (mapped, not read); if none, the build says so."""
    if not names or config.resume is None:
        return config
    from imagenet_elastic.checkpoint import store

    path = (os.path.join(config.checkpoints_path, LAST_FILE) if config.resume == RESUME_AUTO
            else store.resume_file(config.resume))
    if not os.path.isfile(path):
        return config
    snapshot = store.load(path, lazy=True)
    saved = {name: saved_setting(snapshot.get("config", {}), name) for name in names}
    if "model" in names:
        saved["model"] = snapshot.get("model_name", config.model)
    return dataclasses.replace(config, **saved)


def config_from_args(args: argparse.Namespace) -> Config:
    """Lists from nargs=2 options become tuples, as the defaults are."""
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k not in NOT_SETTINGS}
    return Config(**values)


# each a module with `main(argv)`, imported only when asked for
SUBCOMMANDS = {
    "benchmark": ("imagenet_elastic.tools.benchmark", "measure the loader, the model and both together"),
    "evaluate": ("imagenet_elastic.tools.evaluate", "a checkpoint's, export's or timm model's scores on val sets"),
    "export": ("imagenet_elastic.tools.export", "a checkpoint's weights and preprocessing for timm / Hugging Face"),
    "pack": ("imagenet_elastic.tools.pack", "ImageNet (folders or parquet) as indexed tar shards"),
    "plot": ("imagenet_elastic.tools.plot", "a run's curves as one picture"),
}


def check_environment() -> None:
    """What every command meets before its first import of timm (which imports torch's compiler), said in one line."""
    from imagenet_elastic.models.compile_cache import check_cache_folders

    try:
        check_cache_folders(os.environ)
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:  # a data folder called "export" is ./export
        try:
            check_environment()
            importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:])
        except KeyboardInterrupt:  # as the trainer's: one line (rank 0's), no traceback; pack says its own line
            if os.environ.get("RANK", "0") == "0":
                print(f"{PROG}: {argv[0]} stopped by Ctrl-C", file=sys.stderr, flush=True)
            sys.exit(INTERRUPTED_EXIT)
        return
    args = None
    try:
        config, args = parse(argv)
        if args.print_config:
            sys.stdout.write(settings_yaml(config, "imagenet_elastic settings (--print-config); run them with "
                                                   "--config"))
            return
        from imagenet_elastic.launch.distributed import uses_cuda, visible_gpu_count
        from imagenet_elastic.launch.launchers import resolve_launch

        plan = resolve_launch(config.dist_init_method, os.environ, local_rank_arg=args.local_rank,
                              nproc_per_node=config.nproc_per_node, master_port=config.master_port,
                              dist_url=config.dist_url, visible_gpus=visible_gpu_count(os.environ),
                              uses_gpus=uses_cuda(config.device))
    except UserError as error:  # no rank is known yet: every process reports
        if args is not None:  # a flag the --config file alone set (`dist-url: nonsense`): named by file and key
            named_by_file(error, args.config, args.file_only)
        report(error, rank=0)
        sys.exit(error.exit_code)
    check_environment()
    from imagenet_elastic.launch.processes import run_worker, spawn_workers

    if config.evaluate:  # pytorch/examples' flag, in front of `imagenet-elastic evaluate`'s one code path
        from imagenet_elastic.tools.evaluate import evaluate_checkpoint as entry
    else:
        from imagenet_elastic.train.trainer import run as entry

    if args.file_only:
        entry = functools.partial(names_the_file, entry, args.config, args.file_only)
    try:
        if plan.spawns:
            spawn_workers(entry, config, plan.env, plan.procs_per_task)
        else:
            run_worker(entry, config, plan.env)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED_EXIT)


def names_the_file(entry: Callable[[Config, Any], None], path: str, file_only: Mapping[str, Any], config: Config,
                   env: Any) -> None:
    """A rank's `entry`, whose errors name the --config file where the flag they name was set, the file alone: a
    `model: nosuch` the build meets long after the parse. Module level, so that spawn can pickle it."""
    try:
        entry(config, env)
    except UserError as error:
        named_by_file(error, path, file_only)
        raise


BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE, as a shell reports a command its pipe's reader left


def program() -> NoReturn:
    """`python -m imagenet_elastic` and the `imagenet-elastic` command: `main`, then an exit that skips the
    interpreter's teardown: with torch imported it takes seconds on a small machine, paid by every rank at every
    restart, and is where gloo's occasional abort at exit came from. Exit handlers still run."""
    # timm imports the W&B client wherever installed (~0.5 s of CPU per rank's start): a None in sys.modules makes
    # that import fail; --wandb takes it out again (report.sinks.installed).
    sys.modules.setdefault("wandb", None)
    try:
        main()
        code = 0
    except KeyboardInterrupt:  # before anything started (parsing, imports): nothing to say
        code = INTERRUPTED_EXIT
    except BrokenPipeError:  # its reader stopped reading (`| head -1`): it had what it wanted
        code = BROKEN_PIPE_EXIT
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message")
            sys.stderr.write(f"{stop.code}\n")
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`): nothing more to say
            stream.flush()
    os._exit(code)

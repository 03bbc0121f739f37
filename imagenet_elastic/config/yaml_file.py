"""Settings in a YAML file: `--config FILE.yaml` reads them, `--print-config` and every run's `config.yaml` write
them, in the same form, so a printed or saved file runs again as it is. Flat option names and values, passed through
the command line's argparse types, so a bad value fails the same way."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from typing import Any, Optional

import yaml

from imagenet_elastic.atomic_files import store_bytes
from imagenet_elastic.config import Config, check_each, flag
from imagenet_elastic.errors import UserError
from imagenet_elastic.options import Parser

FILE_NAME = "config.yaml"  # beside the checkpoints: the settings of the run that wrote them


def read_settings(path: str, parser: Parser) -> dict[str, Any]:
    """The file's settings, converted and checked by `parser` (a fresh one: its errors name the file)."""
    try:
        with open(path) as f:
            loaded = yaml.load(f, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except UserError as error:  # a key set twice (UniqueKeyLoader)
        raise UserError(f"config file {path}: {error}") from None
    except OSError as error:
        raise UserError(f"cannot read config file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise UserError(f"config file {path} is not UTF-8 text ({error.reason}: byte "
                        f"{error.object[error.start]:#04x})") from None
    except yaml.YAMLError as error:
        raise UserError(f"config file {path} is not valid YAML: {' '.join(str(error).split())}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"config file {path}: expected option names and values, got a {type(loaded).__name__}")
    fields = Config.__dataclass_fields__
    tokens: list[str] = []
    positional: list[str] = []
    nulls: dict[str, Any] = {}  # settings the file resets to their default
    named: list[str] = []  # settings the file gives a value, which the parser converts
    for key, value in loaded.items():
        f = fields.get(str(key).replace("-", "_"))
        if f is None:
            close = difflib.get_close_matches(str(key).replace("_", "-"),
                                              [name.replace("_", "-") for name in fields], n=1)
            hint = f" (did you mean {close[0]}?)" if close else " (see --help)"
            raise UserError(f"config file {path}: unknown option {key!r}{hint}")
        if value is None:  # null: the default, where the default is itself "nothing" (as settings_yaml writes it)
            if file_value(f.name, f.default) is not None:  # DATA's default, MISSING, too
                raise UserError(f"config file {path}: {key} needs a value")
            nulls[f.name] = f.default
            continue
        named.append(f.name)
        if f.metadata.get("positional"):  # DATA: its value alone, last: after `--` nothing is read as an option
            positional = ["--", *option_tokens(f, value, path)[1:]]
        else:
            tokens += option_tokens(f, value, path)
    parser.source = path
    parsed = parser.parse_args(tokens + positional)
    values = {**nulls, **{name: getattr(parsed, name) for name in named}}
    for name in (*PATH_SETTINGS, "checkpoints_path", "resume"):  # as a shell expands them on the command line
        if isinstance(values.get(name), str) and values[name].startswith("~"):
            values[name] = os.path.expanduser(values[name])
    try:
        check_each(values)
    except UserError as error:
        raise UserError(f"config file {path}: {error}") from None
    return values


def named_by_file(error: UserError, path: str, file_only: Mapping[str, Any]) -> UserError:
    """`error`, where it names a setting the config file alone gave a value (by its flag, or by its value where that is
    a path: `data: /nosuch`), reworded to name the file and key: `config file run.yaml sets progressive-resize: ...`.
    The same error object: its class (exit code, which rank says it) stays."""
    text = str(error)
    keys = [name.replace("_", "-") for name in file_only if re.search(rf"--{name.replace('_', '-')}(?![\w-])", text)]
    keys = keys or [name.replace("_", "-") for name, value in file_only.items()  # else by a path it names
                    if isinstance(value, str) and os.sep in value and value in text]
    if keys and not text.startswith(f"config file {path} "):
        error.args = (f"config file {path} sets {', '.join(sorted(keys))}: {text}",)
    return error


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's, but a key set twice is refused, where safe_load keeps the last silently; `batch-size` and
    `batch_size` are one key, as they are one option."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: SafeLoader's to merge
                continue
            key = str(self.construct_object(key_node, deep=deep)).replace("_", "-")
            if key in lines:
                raise UserError(f"{key} is set twice (lines {lines[key]} and {key_node.start_mark.line + 1})")
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def option_tokens(f: dataclasses.Field, value: Any, path: str) -> list[str]:
    """One file entry as the command line would say it: `hflip: 0` -> ['--hflip', '0']; `resume: true` -> the
    bare flag, `resume: false` nothing (its default)."""
    arguments = f.metadata.get("argparse", {})  # DATA, a positional, has none
    action, nargs = arguments.get("action"), arguments.get("nargs")
    name = flag(f)
    key = f"config file {path}: {f.name.replace('_', '-')}"
    if action is argparse.BooleanOptionalAction or action == "store_true":
        if not isinstance(value, bool):
            raise UserError(f"{key} must be true or false, got {value!r}")
        return [name] if value else [] if action == "store_true" else ["--no-" + name[2:]]
    if isinstance(value, bool):  # not the words "True" and "False": a path, a model, a signal named so
        if nargs == "?":
            return [name] if value else []
        raise UserError(f"{key} takes a value, not {str(value).lower()} (YAML reads yes/no/on/off as true/false: "
                        f"quote a word)")
    if isinstance(value, dict):  # `model: {name: resnet50}`: no setting is a mapping
        raise UserError(f"{key} takes one value, not a mapping: got {value!r}")
    if isinstance(nargs, int):
        if not isinstance(value, list) or len(value) != nargs:
            raise UserError(f"{key} takes a list of {nargs} values, got {value!r}")
        return [name, *map(str, value)]
    if isinstance(value, list):  # preempt-signals: [SIGTERM, SIGUSR1]; progressive-resize: [160, 192]
        if "tuple[" not in str(f.type):  # a setting of one value
            raise UserError(f"{key} takes one value, not a list: got {value!r}")
        if not value and f.name == "preempt_signals":  # none, as settings_yaml writes it (file_value)
            return [name, "none"]
        return [name, ",".join(map(str, value))]
    return [name, str(value)]


# left out of a run's config.yaml, so `--config DIR/config.yaml` reruns the settings as a new run instead of
# resuming, or refusing, the old one
RUN_LOCATION = ("checkpoints_path", "resume")


def settings_yaml(config: Config, header: Optional[str] = None, leave_out: tuple[str, ...] = ()) -> str:
    """Every setting of `config` but `leave_out`, in the form read_settings reads."""
    values = {f.name.replace("_", "-"): file_value(f.name, getattr(config, f.name)) for f in dataclasses.fields(Config)
              if f.name not in leave_out}
    text = yaml.safe_dump(values, sort_keys=False, default_flow_style=None, width=120)
    return (f"# {header}\n" if header else "") + text


def file_value(name: str, value: Any) -> Any:
    if name == "checkpoint_interval":  # (500, 600.0) -> "500,600s"
        steps, seconds = value
        parts = ([str(steps)] if steps else []) + ([f"{exact(seconds)}s"] if seconds else [])
        return ",".join(parts) or None
    if name == "preempt_signals":
        return list(value) or "none"
    return list(value) if isinstance(value, tuple) else value


def exact(number: float) -> str:
    """A number's shortest text that reads back as the same float, as an integer where it is one: 600, 1234567, 0.1
    (`:g` would write 1.23457e+06 and a run would save every 1234570 s)."""
    return str(int(number)) if number.is_integer() else repr(number)


PATH_SETTINGS = ("data", "val_path", "val_labels", "initial_checkpoint", "teacher")  # a timm name is no path here


def write(folder: str, config: Config) -> None:
    """FOLDER/config.yaml: the settings of the run whose checkpoints the folder holds, but RUN_LOCATION; written
    with its first checkpoint, so a run that fails before saving anything leaves the file as it was. Relative paths
    are written absolute: the file is read again from wherever its user stands."""
    config = dataclasses.replace(config, **{
        name: os.path.abspath(value) for name in PATH_SETTINGS
        if isinstance(value := getattr(config, name), str) and not os.path.isabs(value) and os.path.exists(value)})
    text = settings_yaml(config, "settings of the run that wrote these checkpoints; rerun them as a new run with "
                                 "--config and a --checkpoints-path of its own (this file names none)", RUN_LOCATION)
    store_bytes(text.encode(), os.path.join(folder, FILE_NAME))

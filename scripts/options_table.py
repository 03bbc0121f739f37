#!/usr/bin/env python
"""docs/OPTIONS.md's option table, made from the Config fields the command line is made from.

    python scripts/options_table.py           # print it
    python scripts/options_table.py --write   # replace the table between docs/OPTIONS.md's markers
"""

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from imagenet_elastic.cli import build_parser
from imagenet_elastic.config import Config
from imagenet_elastic.options import shown

OPTIONS = Path(__file__).resolve().parents[1] / "docs" / "OPTIONS.md"
TABLE = re.compile(r"(<!-- options table: .*? -->\n)(.*?)(\n<!-- end of options table -->)", re.DOTALL)


def options_table() -> str:
    """The table, from the same fields as the parser, each option written as --help writes it."""
    actions = {action.dest: action for action in build_parser()._actions}
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Config):
        rows.append(f"| `{invocation(actions[f.name])}` | {shown_default(f)} | {f.metadata['help']} |")
    return "\n".join(rows)


def invocation(action: argparse.Action) -> str:
    """`--batch-size N`, `--amp {auto,bf16,fp16,off}`, `--x / --no-x`: an option as --help writes it (argparse's own
    rendering is private API)."""
    if not action.option_strings:
        return action.metavar
    flags = " / ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    metavar = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices else
                                 action.dest.upper())
    if action.nargs == "?":
        return f"{flags} [{metavar}]"
    words = metavar if isinstance(metavar, tuple) else (metavar,) * (action.nargs or 1)
    return f"{flags} {' '.join(words)}"


def shown_default(f: dataclasses.Field) -> str:
    """The option table's default column: what --help says (options.shown), as code where it is a value."""
    if f.metadata.get("shown_default") is not None:
        return f.metadata["shown_default"]
    value = f.default
    if value is None or value is False or value is dataclasses.MISSING:
        return ""
    return f"`{shown(value)}`" if isinstance(value, (str, tuple)) else shown(value)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        text = OPTIONS.read_text()
        if not TABLE.search(text):
            sys.exit(f"{OPTIONS}: the option table's markers are missing")
        OPTIONS.write_text(TABLE.sub(lambda m: m.group(1) + options_table() + m.group(3), text))
    else:
        print(options_table())

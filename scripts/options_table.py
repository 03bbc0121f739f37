#!/usr/bin/env python
"""docs/OPTIONS.md's option table, made from the Config fields the command line is made from.

    python scripts/options_table.py           # print it
    python scripts/options_table.py --write   # replace the table between docs/OPTIONS.md's markers
"""

import re
import sys
from pathlib import Path

from imagenet_elastic.cli import options_table

OPTIONS = Path(__file__).resolve().parents[1] / "docs" / "OPTIONS.md"
TABLE = re.compile(r"(<!-- options table: .*? -->\n)(.*?)(\n<!-- end of options table -->)", re.DOTALL)

if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        text = OPTIONS.read_text()
        if not TABLE.search(text):
            sys.exit(f"{OPTIONS}: the option table's markers are missing")
        OPTIONS.write_text(TABLE.sub(lambda m: m.group(1) + options_table() + m.group(3), text))
    else:
        print(options_table())

"""scripts/options_table.py: docs/OPTIONS.md's table is the one the parser is built from."""

from __future__ import annotations

import re

from conftest import REPO
from options_table import options_table


def test_the_option_table_is_the_one_the_parser_is_built_from():
    text = (REPO / "docs" / "OPTIONS.md").read_text()
    table = re.search(r"<!-- options table: .*? -->\n(.*?)\n<!-- end of options table -->", text, re.DOTALL)
    assert table, "docs/OPTIONS.md lost its option table markers"
    stale = "docs/OPTIONS.md's table is stale: python scripts/options_table.py --write"
    assert table.group(1) == options_table(), stale

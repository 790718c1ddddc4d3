"""CSV cells a spreadsheet will not run as formulas: tenants name adapters, keys and targets, and a name that
starts with = + - @ (or a tab or carriage return) would be a formula when an exported file is opened."""

from __future__ import annotations

import json
from typing import Any

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> str:
    """`value` as a CSV cell: None empty, a string as it is, anything else as JSON; quoted with a leading `'`
    where a spreadsheet would read it as a formula."""
    text = "" if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return "'" + text if text[:1] in FORMULA_STARTS else text

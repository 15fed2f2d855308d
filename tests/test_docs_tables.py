"""Every Markdown table in README.md and docs/ renders as one table.

GitHub-flavoured Markdown starts a table at a header row followed by a delimiter row
(``|---|---|``) and ends it at the first line that is not a row. Rows that follow a
paragraph put inside a table are not a table any more: they render as a paragraph of
pipes. So each run of ``|`` lines (outside fenced code) must open with a header and a
delimiter row, and every row must have the header's number of cells (GFM splits a row
at every ``|`` not escaped as ``\\|``, in code spans too).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DELIMITER = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")


def cells(row: str) -> int:
    """Cells of a table row ``| a | b |`` (a leading and a trailing pipe)."""
    return len(re.split(r"(?<!\\)\|", row.strip())) - 2


def table_runs(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each run of consecutive ``|`` lines outside fenced code."""
    runs: list[tuple[int, list[str]]] = []
    fenced = False
    current: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines() + [""], 1):
        if line.startswith("```"):
            fenced = not fenced
        is_row = not fenced and line.lstrip().startswith("|")
        if is_row:
            if not current:
                start = number
            current.append(line.strip())
        elif current:
            runs.append((start, current))
            current = []
    return runs


def problems(text: str) -> list[str]:
    out = []
    for start, rows in table_runs(text):
        if len(rows) < 2 or not DELIMITER.match(rows[1]):
            out.append(f"line {start}: rows without a header and delimiter row (a table cut in two?): {rows[0][:60]}")
            continue
        width = cells(rows[0])
        if cells(rows[1]) != width:
            out.append(f"line {start + 1}: the delimiter row has {cells(rows[1])} cells, the header {width}")
        for offset, row in enumerate(rows[2:], 2):
            if cells(row) != width:
                out.append(f"line {start + offset}: {cells(row)} cells, the header has {width}: {row[:60]}")
    return out


def test_the_check_finds_a_table_cut_by_a_paragraph():
    cut = "| a | b |\n|---|---|\n| 1 | 2 |\n\nA paragraph.\n| 3 | 4 |\n"
    assert problems(cut) and problems("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n")
    assert problems("| a | b |\n|---|---|\n| 1 | 2 |\n\nA paragraph.\n\n| c | d |\n|---|---|\n| 3 | 4 |\n") == []
    assert problems("```\n| not a table\n```\n") == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_is_whole(doc):
    assert problems(doc.read_text()) == []

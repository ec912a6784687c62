"""The README's measured figures are exactly what dev/results_table.py renders from the committed JSON, every
Markdown table of the user documentation is well formed, and the README stays short enough to read."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_BYTES = 13_600
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
SEPARATOR = re.compile(r"^\s*:?-{3,}:?\s*$")


def _generator():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "dev" / "results_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cells(line: str) -> list:
    """The cells of a table row: split at the pipes that are not escaped (``\\|`` is a literal pipe)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return re.split(r"(?<!\\)\|", body)


def tables(text: str) -> list:
    """(first line number, rows) of every Markdown table outside fenced code blocks."""
    found, current, fenced = [], None, False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        is_row = not fenced and line.lstrip().startswith("|")
        if is_row:
            if current is None:
                current = (i, [])
                found.append(current)
            current[1].append(line)
        else:
            current = None
    return found


def malformed(text: str) -> list:
    """A description of every table that lacks its separator row or whose rows differ in cell count."""
    problems = []
    for start, rows in tables(text):
        n = len(_cells(rows[0]))
        if len(rows) < 2 or not all(SEPARATOR.match(c) for c in _cells(rows[1])):
            problems.append(f"line {start}: no separator row (|---|...) under the header")
        for k, row in enumerate(rows[1:], start + 1):
            if len(_cells(row)) != n:
                problems.append(f"line {k}: {len(_cells(row))} cells, the header has {n}: {row[:80]}")
    return problems


def test_readme_block_is_the_generated_one():
    gen = _generator()
    text = README.read_text()
    assert gen.BEGIN in text and gen.END in text, "README.md lacks the results markers of dev/results_table.py"
    block = text[text.index(gen.BEGIN) + len(gen.BEGIN):text.index(gen.END)].strip("\n")
    assert block == gen.readme_block(), "README's results block differs: run python dev/results_table.py --write"


def test_generated_tables_cover_every_result():
    gen = _generator()
    block = gen.readme_block()
    names = sorted(p.name for p in gen.RESULTS.glob("*.json"))
    assert names, "no bench/results/*.json committed"
    rows = sum(len(found) - 2 for _, found in tables(block))  # header and separator excluded
    # one row per op and precision, except one per case for the data-parallel and long-sequence results
    per_case = [n for n in names if n.startswith(("vision_attention_data_parallel_", "varlen_attention_",
                                                  "vision_attention_long_"))]
    case_rows = sum(len(gen.load(n)["cases"]) for n in per_case)
    assert rows == len(names) - len(per_case) + case_rows, f"{rows} summary rows for {len(names)} result files"
    assert not malformed(block)
    assert not malformed(gen.case_tables()), malformed(gen.case_tables())


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_markdown_tables_well_formed(path):
    problems = malformed(path.read_text())
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


def test_table_checker_catches_bad_rows():
    good = "| a | b |\n|---|---|\n| 1 \\| 2 | 3 |\n"
    assert not malformed(good)
    assert malformed("| a | b |\n|---|---|\n| 1 | 2 | |\n")  # an extra (empty) cell
    assert malformed("| a | b |\n| 1 | 2 |\n")  # no separator
    assert not malformed("```\n| not | a table\n```\n")


def test_readme_size():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to docs/"


def test_readme_links_resolve():
    text = README.read_text()
    missing = [t for t in re.findall(r"\]\(([^)#:]+)\)", text) if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"

"""The README's measured tables are exactly what scripts/results_table.py renders from the committed JSON."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tables_match_committed_results():
    rendered = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_table.py")], capture_output=True,
                              text=True, check=True).stdout
    rows = [line for line in rendered.splitlines() if line.startswith("|")]
    assert len(rows) > 60, "results_table.py rendered too few table rows: are bench/results/*.json committed?"
    readme = (ROOT / "README.md").read_text()
    missing = [r for r in rows if r not in readme.splitlines()]
    assert not missing, f"README rows that differ from the committed JSON (first of {len(missing)}): {missing[0]}"
    # and the README has no measured row that the JSON does not produce
    section = readme[readme.index("#### rope_2d_backward"):readme.index("## Development")]
    extra = [line for line in section.splitlines() if line.startswith("|") and line not in rows]
    assert not extra, f"README table rows not produced from the JSON: {extra[:2]}"
    assert re.search(r"GEMM ceiling \d+ TFLOP/s", readme)

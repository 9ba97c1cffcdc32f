"""Every result kept in `benchmarks/results/` can be traced: each JSON line (and each whole `.json` report) names the
command that printed it and the git commit, every results file docs/RESULTS.md cites exists, and every figure of the
findings table that opens docs/RESULTS.md is a value of the lines its row names. Lines whose command could not be
recovered live in `benchmarks/results/untraced/`, which this test does not read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def records(path: Path) -> list[tuple[str, dict]]:
    """The records of a results file, each named `file:line` (a `.json` file is one record, a whole JSON document)."""
    text = path.read_text()
    if path.suffix == ".json":
        return [(path.name, json.loads(text))]
    return [(f"{path.name}:{n}", json.loads(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def result_files() -> list[Path]:
    return sorted([*RESULTS.glob("*.jsonl"), *RESULTS.glob("*.json")])


def test_there_are_results_to_check():
    assert result_files()


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.name)
def test_every_result_names_its_command_and_commit(path):
    untraced = [name for name, record in records(path) if not (record.get("command") and record.get("commit"))]
    assert not untraced, f"no command or commit (recover them, or move the line to results/untraced/): {untraced}"


def test_every_results_file_the_docs_cite_exists():
    """RESULTS.md names a file by its path, or by its bare name after the first path (`smollm2-vs-trl.jsonl`)."""
    text = (ROOT / "docs" / "RESULTS.md").read_text()
    cited = set(re.findall(r"benchmarks/results/((?:untraced/)?[\w.-]+\.jsonl?)\b", text))
    cited |= set(re.findall(r"`((?:untraced/)?[\w.-]+\.jsonl?)`", text))
    assert cited
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert not missing, f"docs/RESULTS.md cites results files that do not exist: {missing}"


# A figure in a findings row: a decimal number (0.579, 52.9), not one written with a sign (+0.047, a difference of two
# figures) nor one inside a word or a code span's name.
FIGURE = re.compile(r"(?<![\w.+])\d+\.\d+")
MARKER = re.compile(r"<!-- lines: ([^;>]*?)(?:; derived: ([^>]*?))? -->")


def findings_rows() -> list[str]:
    """The rows of the findings table that opens docs/RESULTS.md."""
    text = (ROOT / "docs" / "RESULTS.md").read_text()
    table = text.split("## Findings\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| question")]


def numbers(value) -> list[float]:
    """Every number a record holds, at any depth (lists and objects kept as JSON text included)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, str) and value[:1] in "[{":
        try:
            value = json.loads(value)
        except ValueError:
            return []
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    return []


def held(figure: str, values: set[float]) -> bool:
    """`figure` is one of `values` rounded to its printed digits, as printed or converted to the unit the docs print:
    seconds to minutes (/ 60), MiB to GiB (/ 1024)."""
    digits = len(figure.split(".")[1])
    return any(abs(round(v / unit, digits) - float(figure)) < 1e-9 for v in values for unit in (1, 60, 1024))


def test_every_findings_row_names_the_lines_it_comes_from():
    rows = findings_rows()
    assert len(rows) >= 10
    for row in rows:
        marker = MARKER.search(row)
        assert marker, f"a findings row names no results files (<!-- lines: a.jsonl b.jsonl -->): {row[:80]}"
        names = marker.group(1).split()
        assert names and all((RESULTS / name).is_file() for name in names), f"{names}: not all in benchmarks/results/"


@pytest.mark.parametrize("row", findings_rows(), ids=lambda row: row.split(" | ")[0][2:50])
def test_every_figure_of_a_findings_row_is_in_the_lines_it_cites(row):
    """Each decimal figure in a row's answer and numbers is a value of a line in the files its marker names, rounded to
    the digits printed; a figure computed from several (a mean) is listed after `derived:` in the marker."""
    marker = MARKER.search(row)
    assert marker
    values = {n for name in marker.group(1).split() for _, record in records(RESULTS / name) for n in numbers(record)}
    derived = set((marker.group(2) or "").split())
    answer, figures = row.split(" | ")[1:3]
    missing = [f for f in FIGURE.findall(f"{answer} {figures}") if f not in derived and not held(f, values)]
    assert not missing, f"figures no cited line holds: {missing} (files: {marker.group(1)})"

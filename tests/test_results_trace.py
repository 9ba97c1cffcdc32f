"""Every result kept in `benchmarks/results/` can be traced: each JSON line (and each whole `.json` report) names the
command that printed it and the git commit, and every results file docs/RESULTS.md cites exists. Lines whose command
could not be recovered live in `benchmarks/results/untraced/`, which this test does not read."""

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

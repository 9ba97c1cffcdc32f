"""Every benchmark's JSON line carries its command, the commit it started from, and the machine."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))  # as running a script puts its folder first


def test_a_json_line_carries_its_command_commit_and_machine(monkeypatch):
    import provenance as provenance_py
    from provenance import provenance

    monkeypatch.setattr(sys, "argv", ["benchmarks/efficacy.py", "--seeds", "1"])
    line = provenance(threads=1)
    assert line["command"] == "python benchmarks/efficacy.py --seeds 1" and line["threads"] == 1
    assert line["commit"] is None or len(line["commit"].removesuffix("+dirty")) == 40  # a checkout's HEAD
    monkeypatch.setattr(provenance_py, "commit_of", lambda tree: "a later commit")
    assert provenance(threads=1)["commit"] == provenance_py.STARTED_AT != "a later commit"  # the one it started from
    assert line["python"].count(".") == 2 and line["torch"] and line["cpu"]


def test_a_benchmark_imports_the_code_of_the_checkout_it_lives_in(tmp_path):
    """A benchmark run from another worktree (an editable install pointing elsewhere) measures that worktree's code,
    the commit its line names: `harness` puts its own checkout ahead of the installed one."""
    import shutil
    import subprocess

    checkout = tmp_path / "worktree"
    (checkout / "benchmarks").mkdir(parents=True)
    (checkout / "interleave_model").mkdir()
    (checkout / "interleave_model" / "__init__.py").write_text("")
    shutil.copy(Path(__file__).parent.parent / "benchmarks" / "harness.py", checkout / "benchmarks")
    probe = checkout / "benchmarks" / "probe.py"
    probe.write_text("import harness\nimport interleave_model\nprint(interleave_model.__file__)\n")
    out = subprocess.run([sys.executable, str(probe)], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).parent == checkout / "interleave_model"

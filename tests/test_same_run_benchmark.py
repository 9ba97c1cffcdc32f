"""benchmarks/same_run.py: the same short fit from two checkouts, every logged scalar compared; none differs for the
same code, and a changed setting shows in the scalars it moves."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["--", "--trainer.max_steps", "3", "--trainer.log_every_n_steps", "1", "--data.sft_steps", "2",
         "--data.sft_batch_size", "4", "--data.batch_size", "2", "--data.val_pairs", "4",
         "--data.train_pairs", "64"]  # fmt: skip


def _same_run(before: Path, after: Path) -> dict:
    command = [sys.executable, "benchmarks/same_run.py", "--before", str(before), "--after", str(after), *SHORT]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_same_code_logs_the_same_numbers_and_a_change_shows(tmp_path):
    same = _same_run(ROOT, ROOT)
    assert same["differ"] == [] and same["scalars"] > 10 and same["last_step"] == 3
    assert same["before"] == same["after"] and same["fit"][-2:] == ["--data.train_pairs", "64"]

    changed = tmp_path / "changed"  # a copy whose warm start learns at another rate
    changed.mkdir()
    shutil.copy(ROOT / "cli.py", changed)
    for package in ("interleave_model", "interleave_data", "configs"):
        shutil.copytree(ROOT / package, changed / package, ignore=shutil.ignore_patterns("__pycache__"))
    demo = changed / "configs" / "demo.yaml"
    demo.write_text(demo.read_text().replace("sft_learning_rate: 0.002", "sft_learning_rate: 0.004"))
    moved = _same_run(ROOT, changed)
    assert moved["after"] is None and "train/sft_loss" in moved["differ"]

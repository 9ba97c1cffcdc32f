"""benchmarks/climb.py on the test config: an arm from configs through the CLI's parser, tested before and after,
one JSON line with its command, commit, curve and counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_arm_runs_from_its_configs_and_prints_one_line(tmp_path):
    overlay = tmp_path / "arm.yaml"
    data = {"stages": [4, 8], "val_pairs": 4, "curriculum": {"adaptive": {"success": 0.5}}}
    callbacks = [{"class_path": "interleave_model.run.callbacks.CurriculumCallback", "init_args": {"export": False}}]
    trainer = {"max_steps": 8, "val_check_interval": 3, "callbacks": callbacks}
    overlay.write_text(yaml.safe_dump({"trainer": trainer, "data": data}))
    out = tmp_path / "climb.jsonl"
    command = [sys.executable, "benchmarks/climb.py", "--config", str(TINY_CONFIG), "--config", str(overlay),
               "--minutes", "10", "--test-pairs", "4", "--samples", "2", "--bin", "2", "--out", str(out),
               f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}

    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = out.read_text().splitlines()
    arm = json.loads(line)
    assert arm["benchmark"] == "climb" and arm["steps"] == 8 and arm["command"].startswith("python benchmarks/climb.py")
    assert arm["commit"] and arm["configs"] == [str(TINY_CONFIG), str(overlay)]
    for when in ("test_start", "test_end"):
        assert set(arm[when]) == {"4w", "8w"}
        assert {"score", "score_stderr", "exact_match", "pass@1", "pass@2"} <= arm[when]["4w"].keys()
    assert [p["step"] for p in arm["curve"]] == [3, 6] and arm["curve"][0]["length"] >= 4
    assert len(arm["words"]) == 3 and all(4 <= w <= 8 for w in arm["words"])  # 6 GRPO batches in bins of 2
    assert arm["transitions"][0]["kind"] == "milestone"  # 4 words, ungated, passed at the first GRPO batch

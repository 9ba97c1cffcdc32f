"""benchmarks/sft_step.py on the tiny model: one JSON line whose warm-start steps ran, in micro-batches or not."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("micro", [None, 2])
def test_the_warm_start_benchmark_runs_its_steps_and_reports_memory(micro, capsys):
    import sft_step

    argv = ["--model", "tiny", "--words", "4", "--sft-batch-size", "4", "--steps", "2"]
    out = sft_step.main(argv + ([] if micro is None else ["--micro-batch-size", str(micro)]))
    assert out["micro_batch_size"] == micro and out["steps"] == 2 and math.isfinite(out["sft_loss"])
    assert out["peak_rss_mb"] >= out["start_rss_mb"] > 0 and out["command"] and out["commit"]
    assert capsys.readouterr().out.count('"benchmark": "sft_step"') == 1

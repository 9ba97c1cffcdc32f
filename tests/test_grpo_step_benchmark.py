"""benchmarks/grpo_step.py on the tiny model: one JSON line that names what `auto` chose (the merged copy's dtype and
the update's rows a forward), so a line measured with the defaults says which fast path it measured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from interleave_model.generation.merged_copy import DTYPES

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("copy", ["auto", "bfloat16", "prepacked", "none"])
def test_the_step_benchmark_records_the_copy_and_micro_batch_it_ran(copy, capsys):
    import grpo_step

    argv = ["--words", "3", "--steps", "1", "--warmup", "1", "--prompts", "2", "--generations", "2", "--beta", "0",
            "--pairs", "8", "--threads", "1", "--merged-copy", copy]  # fmt: skip
    out = grpo_step.main(argv)
    run = out["words"]["3"]
    assert out["merged_copy"] == copy and out["micro_batch_size"] == "auto"
    # auto takes whichever copy this host times fastest: any of them; prepacked is the bfloat16 copy where oneDNN has
    # no bf16 kernels
    expected = {"auto": set(DTYPES), "bfloat16": {"bfloat16"}, "prepacked": {"prepacked", "bfloat16"}, "none": {None}}
    assert run["merged_copy_dtype"] in expected[copy]
    assert run["micro_batch_size"] is None or 1 <= run["micro_batch_size"] <= 4  # all 4 rows, or a size auto timed
    assert out["command"] and out["commit"]
    assert capsys.readouterr().out.count('"benchmark": "grpo_step"') == 1

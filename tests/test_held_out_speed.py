"""benchmarks/held_out_speed.py: the context its floor counts (a pure function), and one run on the tests' tiny config
whose line holds every length's counts, consistent with each other and with the held-out budget."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("held_out_speed", ROOT / "benchmarks" / "held_out_speed.py")
held_out_speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(held_out_speed)


def test_a_generated_token_reads_the_prompt_and_the_tokens_before_it():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # 3 tokens and 1 token after a 5-column prompt
    # row 0: 5+1, 5+2, 5+3 = 21; row 1: 5+1 = 6
    assert held_out_speed.context_positions(5, mask) == 27
    shape = {"linear_weights": 1000, "head_weights": 500, "hidden": 10, "layers": 2}
    assert held_out_speed.token_flops(shape, 7.0) == {"linear": 2000, "head": 1000, "attention": 4 * 10 * 2 * 7.0}


def test_one_line_per_run_with_every_length_counted():
    command = [sys.executable, "benchmarks/held_out_speed.py", "--config", "tests/configs/tiny.yaml",
               "--lengths", "4", "8", "--pairs", "4", "--threads", "1"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    record = json.loads(line)
    assert record["benchmark"] == "held_out_speed" and record["eval_batch_size"] == 4
    assert record["positions"] == "interleave" and record["shape"]["layers"] == 1
    assert [length["n_words"] for length in record["lengths"]] == [4, 8]
    for length in record["lengths"]:
        assert length["pairs"] == 4 and length["prompt_tokens"] == 2 * length["n_words"] + 3  # compact, no BOS
        assert length["budget"] == 3 * 2 * length["n_words"] + 8  # the held-out answer budget
        # one eval batch: every row's tokens fit in its decode steps, at most the budget's
        assert 0 < length["generated_tokens"] <= length["pairs"] * length["decode_steps"]
        assert length["decode_steps"] <= length["budget"]
        assert length["generated_tokens"] >= length["answers_at_budget"] * length["budget"]
        assert length["prompt_tokens"] < length["mean_context"] <= length["prompt_tokens"] + length["budget"]
        assert length["tokens_per_cpu_s"] == pytest.approx(length["generated_tokens"] / length["cpu_seconds"], 0.05)
        assert length["tokens_per_s"] == pytest.approx(length["generated_tokens"] / length["seconds"], 0.05)
        assert set(length["gflops_per_s"]) == {"linear", "head", "attention", "prefill"}
        assert length["prefill_tokens"] == length["pairs"] * length["prompt_tokens"]  # one length: no padding
        assert 0 < length["floor_share"] < 1 and length["floor_tokens_per_s"] > 0 and length["mflop_per_token"] > 0
    assert record["command"].startswith("python benchmarks/held_out_speed.py") and record["commit"]

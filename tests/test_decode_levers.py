"""benchmarks/decode_levers.py on the Llama-3 test fixture: one JSON line with every variant's decode-step time, and a
merged adapter that scores the prompt as the unmerged one does (float32), the check that makes `merged` a fair row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_every_variant_is_timed_and_the_merged_adapter_scores_alike():
    command = [sys.executable, "benchmarks/decode_levers.py", "--rows", "4", "--generations", "2", "--new-tokens", "4",
               "--prompt-tokens", "12", "--repeats", "1", "--threads", "1", "--int8"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    record = json.loads(line)
    prepacked = {"copy_bfloat16_prepacked"} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
    assert set(record["ms_per_step"]) == {"lora", "lora_no_autocast", "merged", "base", "int8", "copy_float32",
                                          "copy_bfloat16", *prepacked}  # fmt: skip
    if prepacked:  # the same weights in another layout: the same distribution, to bfloat16's rounding
        assert 0 <= record["prepacked_max_logprob_diff"] < 0.1
    assert record["int8_kl"] >= 0
    assert 0 <= record["copy_kl"]["float32"] < 1e-5 and record["copy_kl"]["bfloat16"] >= 0
    assert all(ms > 0 for ms in record["ms_per_step"].values())
    assert record["rows"] == 4 and record["new_tokens"] == 4 and record["dtype"] == "float32"
    assert record["logit_scale"] > 0 and record["merged_max_logit_diff"] < 1e-3 * max(record["logit_scale"], 1.0)
    assert record["command"].startswith("python benchmarks/decode_levers.py") and record["commit"]

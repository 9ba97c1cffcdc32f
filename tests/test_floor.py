"""benchmarks/floor.py: the work it counts for a step (a pure function), and one run on the tiny model whose floor
lies below what the step measured, per phase."""

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
spec = importlib.util.spec_from_file_location("floor", ROOT / "benchmarks" / "floor.py")
floor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floor)

SHAPE = {"linear_weights": 1000, "head_weights": 500, "hidden": 10, "intermediate": 40, "layers": 2,
         "weight_bytes": 6000}  # fmt: skip


def test_the_step_work_counts_each_token_once_and_the_backward_by_what_trains():
    lora = floor.step_work(SHAPE, groups=1, rows=2, prompt=4, completion=3, lora=True, beta=0.0)
    attention = 4 * 10 * 2
    prefill = 4 * (2 * 1000 + attention * 2)
    decode = 2 * 3 * (2 * 1000 + 2 * 500 + attention * (4 + 1.5))
    assert lora["rollout_flops"] == pytest.approx(prefill + decode)
    forward = (4 + 6) * 2000 + 6 * 1000 + attention * (8 + 6 * 5.5)  # the prompt once, every completion token
    assert lora["update_flops"] == pytest.approx(2 * forward)
    full = floor.step_work(SHAPE, groups=1, rows=2, prompt=4, completion=3, lora=False, beta=0.0)
    assert full["update_flops"] == pytest.approx(3 * forward)  # the weights' gradients too
    with_reference = floor.step_work(SHAPE, groups=1, rows=2, prompt=4, completion=3, lora=True, beta=0.04)
    assert with_reference["update_flops"] == pytest.approx(3 * forward)
    assert lora["rollout_bytes"] == 3 * 6000  # the weights once per decode step


def test_on_the_tiny_model_the_floor_lies_below_the_measured_step():
    command = [sys.executable, "benchmarks/floor.py", "--model", "tiny", "--template", "compact", "--threads", "1",
               "--steps", "1", "--warmup", "1", "--prompts", "2", "--generations", "2"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    record = json.loads(line)
    assert record["completion_tokens"] > 0 and record["prompt_tokens"] > 0
    assert all(record["gflop"][phase] > 0 for phase in ("rollout", "update"))
    assert all(0 < record["share"][phase] < 1 for phase in ("rollout", "update", "step")), record["share"]
    assert record["command"].startswith("python benchmarks/floor.py") and record["commit"]


def test_each_phase_is_floored_in_the_dtype_it_runs_in_and_the_step_gets_the_levers():
    ours, step = floor.parse(["--merged-copy", "bfloat16", "--bf16", "--micro-batch-size", "8"])
    assert floor.phase_dtypes(ours) == {"rollout": "bfloat16", "update": "bfloat16"}
    assert (step.merged_copy, step.bf16, step.micro_batch_size) == ("bfloat16", True, 8)
    plain, plain_step = floor.parse([])
    assert floor.phase_dtypes(plain) == {"rollout": "float32", "update": "float32"}
    assert (plain_step.merged_copy, plain_step.bf16) == ("none", False)  # from the policy, not a measured choice
    policy = torch.nn.Module()  # 10 + 3 weights of the base, 8 of an adapter
    policy.base, policy.bias = torch.nn.Parameter(torch.zeros(2, 5)), torch.nn.Parameter(torch.zeros(3))
    policy.lora_A = torch.nn.Parameter(torch.zeros(2, 4))
    assert floor.merged_weight_bytes(policy, "bfloat16") == 13 * 2  # the adapter is merged in: not read again
    assert floor.merged_weight_bytes(policy, "float32") == 13 * 4
    own = floor.step_work(SHAPE, groups=1, rows=2, prompt=4, completion=3, lora=True, beta=0.0)
    copy = floor.step_work(SHAPE, groups=1, rows=2, prompt=4, completion=3, lora=True, beta=0.0,
                           rollout_weight_bytes=3000)  # fmt: skip
    assert own["rollout_bytes"] == 3 * 6000 and copy["rollout_bytes"] == 3 * 3000  # a copy's bytes once a step
    assert copy["rollout_flops"] == own["rollout_flops"]


def test_a_floor_refuses_a_measured_micro_batch_in_one_line():
    command = [sys.executable, "benchmarks/floor.py", "--model", "tiny", "--micro-batch-size", "auto"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "a floor needs a known size" in done.stderr.strip().splitlines()[-1]
    assert floor.parse(["--micro-batch-size", "8"])[0].micro_batch_size == 8
    assert floor.parse(["--micro-batch-size", "all"])[0].micro_batch_size is None

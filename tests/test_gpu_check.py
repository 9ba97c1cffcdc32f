"""benchmarks/gpu_check.py: its one-line refusal without a GPU, its phases on a CPU (`--cpu-smoke`), its time guard
(gpu_phase_process.py), the module its steps build (gpu_step.py) and the bandwidth table (harness.py)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # as running the script puts its folder first: its helpers import from there
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)  # stdlib only at import: what the refusal relies on
harness, gpu_phase_process, gpu_phases, gpu_step = (
    importlib.import_module(name) for name in ("harness", "gpu_phase_process", "gpu_phases", "gpu_step")
)

STEP_KEYS = ("step_s", "rollout_s", "reward_s", "update_s", "generated_tokens", "decode_steps", "tokens_per_s",
             "rollout_tokens_per_s", "weight_bytes", "hbm_bound_share", "peak_gpu_allocated_mb",
             "peak_gpu_reserved_mb")  # fmt: skip
TRACE_KEYS = ("command", "commit", "python", "torch", "cpu", "threads")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs")
def test_without_a_gpu_it_refuses_in_one_line():
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ") and "GPU" in line
    assert done.stdout == ""


def test_a_gpu_torch_cannot_use_is_refused_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "gpu_device", lambda: True)  # a device file, and torch sees no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("interleave_model.runtime.machine.no_gpu_reason", lambda: "the driver 535.104.05 is too old")

    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err == "error: the driver 535.104.05 is too old\n"  # not "no CUDA GPU"


@pytest.mark.slow
def test_cpu_smoke_writes_every_phase_with_its_trace(tmp_path):
    out = tmp_path / "check.jsonl"
    command = [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in done.stdout.splitlines()] == lines  # printed and appended alike
    phases = ["environment", "random_model", "grpo_step", "grpo_step", "speculation", "grpo_step", "grpo_step"]
    assert [line["phase"] for line in lines] == [*phases, "smollm2_fit"]
    for line in lines:
        assert "error" not in line, line
        assert line["benchmark"] == "gpu_check" and line["cpu_smoke"] is True
        assert all(key in line for key in TRACE_KEYS)
        assert line["command"].endswith(f"benchmarks/gpu_check.py --cpu-smoke --out {out}")
        assert line["commit"] is None or len(line["commit"].removesuffix("+dirty")) == 40

    environment = lines[0]
    assert environment["gpu"] is None and environment["torch"] == torch.__version__
    assert all(key in environment for key in ("cuda", "vllm", "bf16", "gpu_memory_gib"))
    steps = {(line["engine"], line["gradient_checkpointing"], line["long"]): line for line in lines
             if line["phase"] == "grpo_step"}  # fmt: skip
    assert set(steps) == {("own", True, False), ("own", False, False), ("vllm", True, False), ("vllm", True, True)}
    long = steps["vllm", True, True]  # the long stage with the curriculum's held-out answer budget there
    assert "skipped" in long or (long["words"], long["max_new_tokens"]) == (25, 3 * 2 * 25 + 8)
    assert all(step["words"] == 10 for key, step in steps.items() if not key[2] and "skipped" not in step)
    vllm_imports = importlib.util.find_spec("vllm") is not None
    for (engine, *_), step in steps.items():
        if engine == "vllm" and not vllm_imports:
            assert "skipped" in step
            continue
        assert all(key in step for key in STEP_KEYS), step
        assert step["step_s"] > 0 and step["rollout_s"] > 0 and step["update_s"] > 0
        assert 0 < step["generated_tokens"] <= 2 * 4 * step["decode_steps"]  # 2 prompts x 4 completions
        assert step["tokens_per_s"] > 0 and step["hbm_bound_share"] is None  # no GPU: no bandwidth
    speculation = lines[4]  # the tiny model's own greedy answers drafted are kept whole; its targets hardly
    ceiling, floor = speculation["ceiling"], speculation["floor"]
    assert speculation["rows"] == 8 and ceiling["greedy_equal"] and floor["greedy_equal"]
    assert ceiling["kept_share"] == 1.0 and ceiling["tokens_per_forward"] > floor["tokens_per_forward"]
    assert ceiling["forwards"] < floor["forwards"] and min(*ceiling["rollout_s"], *floor["rollout_s"]) > 0
    fit = lines[-1]
    assert fit["steps"] == 1 and 0.0 <= fit["score_before"] <= 1.0 and 0.0 <= fit["score_after"] <= 1.0


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGALRM: main thread only")
def test_the_time_guard_stops_a_phase():
    started = time.perf_counter()
    with pytest.raises(gpu_phase_process.PhaseTimeout, match="time guard of 1 s"), gpu_phase_process.time_guard(1):
        time.sleep(10)
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize(
    "name, bandwidth",
    [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H200", 4.8e12),
     ("NVIDIA A100-SXM4-80GB", 2.0e12), ("NVIDIA A100 80GB PCIe", 2.0e12), ("NVIDIA A100-SXM4-40GB", None),
     ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None), (None, None)],
)  # fmt: skip
def test_nominal_bandwidth_by_gpu_name(name, bandwidth):
    assert harness.nominal_bandwidth(name) == bandwidth


def test_the_module_is_built_from_every_key_of_the_config():
    """Rewards, dynamic sampling and every group come from the YAML as `cli.py` parses it; a change updates one
    group's keys and keeps the rest."""
    model = gpu_step.config("smollm2.yaml")["model"] | {
        "rewards": [{"class_path": "interleave_model.algorithm.rewards.AlignmentReward", "init_args": {"weight": 0.5}}],
        "dynamic_sampling": {"max_rounds": 1},
    }
    tiny = {"hidden_size": 16, "num_layers": 1, "num_heads": 1, "intermediate_size": 16}
    module = gpu_step.module_from(
        model, base={"name_or_path": "tiny", "dtype": None}, tiny=tiny, sampling={"num_generations": 2}
    )
    assert [(type(r).__name__, r.weight) for r in module.reward_functions] == [("AlignmentReward", 0.5)]
    assert module.dynamic_sampling.max_rounds == 1 and module.base.disable_dropout
    assert module.sampling.num_generations == 2 and module.sampling.temperature == model["sampling"]["temperature"]
    assert module.hparams.lora.r == model["lora"]["r"] and module.optimization.micro_batch_size == 8
    nulled = gpu_step.module_from(model | {"sampling": None}, base={"name_or_path": "tiny", "dtype": None}, tiny=tiny,
                                   sampling={"num_generations": 2})  # fmt: skip
    assert nulled.sampling.num_generations == 2  # a group set to null in the YAML takes the change too


def test_every_phase_has_a_budget_and_they_fit_the_check():
    assert list(gpu_check.BUDGETS) == list(gpu_check.SMOKE_BUDGETS) == list(gpu_phases.PHASES)
    assert sum(gpu_check.BUDGETS.values()) <= gpu_check.TOTAL_S
    assert gpu_check.TOTAL_S + gpu_check.GRACE_S <= 600  # under 10 minutes, a last phase's grace included

"""benchmarks/gpu_estimates.py prints, per config and stage, the estimates `check --rehearse` prints: the token counts
`check` measures for the tokenizer given, and `interleave_model.preflight.estimates` for Llama-3.2-3B's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from interleave_model.preflight.estimates import estimate_stages

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_each_line_is_the_estimate_of_its_stage_for_the_measured_tokens(monkeypatch, family_folders, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.chdir(tmp_path)
    import gpu_estimates
    import harness
    import yaml
    from transformers import LlamaConfig

    config = "configs/llama-3.2-3b.yaml"  # one stage, 10 words
    out = tmp_path / "lines.jsonl"
    gpu_estimates.main(["--configs", config, "--tokenizer", str(family_folders["llama3"]), "--gib", "80",
                        "--steps", "50", "--out", str(out)])  # fmt: skip

    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert (line["config"], line["words"], line["estimate"], line["gpu_gib"]) == (config, 10, True, 80.0)
    assert line["prompt_tokens"] > 0 and line["answer_tokens"] > 0 and line["command"] and line["commit"]
    model = LlamaConfig(**harness.RANDOM_SHAPES["llama-3.2-3b"])
    run = yaml.safe_load((ROOT / config).read_text())
    (expected,) = estimate_stages(run, {10: (line["prompt_tokens"], line["answer_tokens"])}, model, 80.0)
    assert line["trainer_gib"] == round(expected.memory.trainer_peak, 1) and line["engine_gib"] == 24.0  # 0.3 x 80
    assert line["step_s"] == round(expected.time.step, 1) > 0
    assert line["stage_hours"] == round(50 * expected.time.step / 3600, 2)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == line

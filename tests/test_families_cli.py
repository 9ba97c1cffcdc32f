"""Every verb of the CLI through every real-family model folder (tests/families.py), full fine-tune and LoRA.

One fit per family and mode (2 warm-start steps, then 2 GRPO steps, a stage export at the end) is shared by the
tests: validate / test / predict its checkpoint, export it and load the export with `from_pretrained`, start a new
run from its stage folder, and resume it from a mid-run checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from cli import main
from interleave_model.algorithm.completions import completion_logprobs
from interleave_model.model.policy import is_peft

FAMILY_CONFIG = Path(__file__).parent / "configs" / "family.yaml"
LORA = ["--model.lora.r=4"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # examples are text: one cache serves every family


@pytest.fixture(scope="module", params=[(n, m) for n in ("llama3", "qwen2", "gpt2") for m in ("full", "lora")],
                ids=lambda p: f"{p[0]}-{p[1]}")  # fmt: skip
def fitted(request, family_folders, cache_dir, tmp_path_factory):
    """A 4-step fit of one family in one mode: its CLI, arguments, folder and last checkpoint."""
    name, mode = request.param
    extra = LORA if mode == "lora" else []
    root = tmp_path_factory.mktemp(f"{name}-{mode}")
    args = _args(family_folders[name], cache_dir, *extra)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests that reuse it run (conftest.one_thread): float sums depend on the count
    try:
        cli = main(["fit", *args, f"--trainer.default_root_dir={root}"])
    finally:
        torch.set_num_threads(threads)
    (checkpoint,) = root.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    return {"cli": cli, "args": args, "root": root, "checkpoint": checkpoint, "folder": family_folders[name],
            "mode": mode}  # fmt: skip


def _args(folder: Path, cache_dir: Path, *extra: str) -> list[str]:
    return ["--config", str(FAMILY_CONFIG), f"--model.base.name_or_path={folder}", f"--data.cache_dir={cache_dir}",
            *extra]  # fmt: skip


def _policy_state(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.policy.state_dict().items()}


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_fit_warm_starts_then_trains_with_grpo(fitted, family_folders):
    cli = fitted["cli"]
    assert cli.trainer.global_step == 4
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and "train/sft_loss" in metrics  # SFT ran, then GRPO
    assert "val/alignment_3w" in metrics
    policy = cli.model.policy
    if fitted["mode"] == "lora":
        assert is_peft(policy) and cli.model.reference is None  # the reference is the adapter switched off
        trained = [p for n, p in policy.named_parameters() if "lora_B" in n]
        assert trained and all(p.abs().sum() > 0 for p in trained)
    else:
        start = AutoModelForCausalLM.from_pretrained(fitted["folder"]).state_dict()
        moved = [k for k, v in policy.state_dict().items() if not torch.equal(v, start[k])]
        assert moved and cli.model.reference is not None


@pytest.mark.parametrize("verb", ["validate", "test"])
def test_evaluate_the_checkpoint(fitted, verb, tmp_path):
    cli = main([verb, *fitted["args"], f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={fitted['checkpoint']}"])
    report = json.loads((Path(cli.trainer.log_dir) / "eval" / "report.json").read_text())
    assert report["split"] == ("val" if verb == "validate" else "test")
    assert [(row["n_words"], row["pairs"]) for row in report["lengths"]] == [(3, 2)]
    assert report["model"]["global_step"] == 4


def test_predict_the_checkpoint(fitted, tmp_path):
    out = tmp_path / "predictions.jsonl"
    main(["predict", *fitted["args"], f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={fitted['checkpoint']}",
          f"--predictions.output_path={out}"])  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["target"] and isinstance(record["completion"], str) and 0.0 <= record["score"] <= 1.0


def test_export_loads_with_from_pretrained_and_gives_the_same_logprobs(fitted, tmp_path):
    out = tmp_path / "export"
    main(["export", *fitted["args"], f"--ckpt_path={fitted['checkpoint']}", f"--output_dir={out}"])

    if fitted["mode"] == "lora":
        assert (out / "adapter_config.json").exists() and not (out / "config.json").exists()
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fitted["folder"]), out)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(out)
    module = fitted["cli"].model
    ids = module.tokenizer(["a b c d", "e f"], return_tensors="pt", padding=True)
    completion = torch.tensor([[5, 6, 7], [8, 9, 10]])  # [2, 3]
    input_ids = torch.cat([ids.input_ids, completion], dim=1)  # [2, Lp+3]
    attention = torch.cat([ids.attention_mask, torch.ones_like(completion)], dim=1)  # [2, Lp+3]
    with torch.no_grad():
        expected, _ = completion_logprobs(module.policy.eval(), input_ids, attention, completion, temperature=1.0)
        actual, _ = completion_logprobs(loaded.eval(), input_ids, attention, completion, temperature=1.0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_init_from_the_stage_folder(fitted, tmp_path):
    stage = fitted["root"] / "lightning_logs" / "version_0" / "stages" / "3words"
    assert (stage / "export.json").exists()
    root = f"--trainer.default_root_dir={tmp_path}"
    cli = main(["validate", *fitted["args"], root, f"--model.base.init_from={stage}"])
    _assert_same_weights(_policy_state(cli), _policy_state(fitted["cli"]))  # written at the end of fit


def test_resume_ends_with_the_weights_of_a_straight_run(fitted, tmp_path):
    stop = ["--trainer.callbacks+=tests.test_resume.StopAfter", "--trainer.callbacks.steps=3"]  # inside GRPO
    half = main(["fit", *fitted["args"], f"--trainer.default_root_dir={tmp_path}", *stop])
    checkpoint = tmp_path / "half.ckpt"
    half.trainer.save_checkpoint(checkpoint)
    resumed = main(["fit", *fitted["args"], f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={checkpoint}"])
    assert resumed.trainer.global_step == 4
    _assert_same_weights(_policy_state(resumed), _policy_state(fitted["cli"]))

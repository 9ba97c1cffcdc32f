"""benchmarks/efficacy.py keeps warm starts between processes (`--warm-dir`): one is reused only by runs whose settings
built the same weights; and every benchmark's JSON line carries its command, commit and machine."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # as running the script puts its folder first: its helpers import from there
spec = importlib.util.spec_from_file_location("efficacy", BENCHMARKS / "efficacy.py")
efficacy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(efficacy)

ARGS = dict(model="smollm2-135m-instruct", lora_r=16, lora_top_layers=None, template="compact",
            sft_learning_rate=1e-3, sft_batch_size=16, warmup_steps=2, train_pairs=5000, val_pairs=128,
            eval_every=10, warm_val_pairs=32, warm_eval_every=5, learning_rate=1e-4, temperature=1.0,
            num_generations=8, reward="alignment", guidance=0.0)  # fmt: skip


def name(**changes) -> str:
    return efficacy.warm_name(Namespace(**(ARGS | changes)), 0, 10, None, 60, 0.5)


@pytest.mark.parametrize("change", [{"lora_top_layers": 8}, {"lora_r": 8}, {"sft_learning_rate": 3e-4},
                                    {"sft_batch_size": 32}, {"train_pairs": 500}, {"template": "chat"},
                                    {"warm_val_pairs": 64}, {"warm_eval_every": 10}])  # fmt: skip
def test_a_setting_that_shapes_the_warm_start_names_another_file(change):
    assert name(**change) != name()


def test_grpo_settings_share_the_warm_start():
    assert name(learning_rate=1e-3, temperature=0.7, num_generations=16) == name()
    # the arms' own held-out evaluations and what they train with do not shape the warm start
    assert name(val_pairs=64, eval_every=5, reward="both_streams", guidance=0.5) == name()
    assert name().startswith("warm-smollm2-135m-instruct-0-10-60-0.5-") and name().endswith(".ckpt")


def test_a_json_line_carries_its_command_commit_and_machine(monkeypatch):
    import provenance as provenance_py
    from provenance import provenance

    monkeypatch.setattr(sys, "argv", ["benchmarks/efficacy.py", "--arms", "lift"])
    line = provenance(threads=1)
    assert line["command"] == "python benchmarks/efficacy.py --arms lift" and line["threads"] == 1
    assert line["commit"] is None or len(line["commit"].removesuffix("+dirty")) == 40  # a checkout's HEAD
    monkeypatch.setattr(provenance_py, "_commit", lambda: "a later commit")
    assert provenance(threads=1)["commit"] == provenance_py.STARTED_AT != "a later commit"  # the one it started from
    assert line["python"].count(".") == 2 and line["torch"] and line["cpu"]

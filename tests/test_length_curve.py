"""benchmarks/length_curve.py counts what the answers earn at each length: a model that answers exactly everywhere
scores 1 with every sample a success; one whose procedure stops past a length scores below it and succeeds nowhere
there; the JSON line carries the route, seed, command and commit."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from interleave_model.module import InterleaveGRPO
from tests.conftest import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent


def _answering(monkeypatch, longest: int | None) -> None:
    """Every answer (greedy and sampled) is the target up to `longest` words a fragment; past it, the target's first
    half (score 0.5, below the success level 0.9). None: exact at every length."""

    def answers(self, batch, batch_idx):
        def answer(target: str, n_words: int) -> str:
            words = target.split()
            return target if longest is None or n_words <= longest else " ".join(words[: len(words) // 2])

        greedy = [answer(t, n) for t, n in zip(batch["targets"], batch["n_words"], strict=True)]
        n = self.evaluator.settings.num_samples
        return greedy, [[g] * n for g in greedy] if n else None

    monkeypatch.setattr(InterleaveGRPO, "_answers", answers)


@pytest.fixture
def curve(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from length_curve import length_curve

    def run(longest: int | None) -> dict[int, dict]:
        _answering(monkeypatch, longest)
        extra = ["--trainer.default_root_dir", str(tmp_path), "--data.curriculum.threshold", "0.9"]
        lines = length_curve([str(TINY_CONFIG)], None, 0, [2, 3, 5], pairs=4, samples=2, extra=extra)
        return {line["n_words"]: line for line in lines}

    return run


def test_a_model_exact_at_every_length_succeeds_everywhere(curve):
    lines = curve(None)
    assert sorted(lines) == [2, 3, 5]
    for line in lines.values():
        assert (line["score"], line["exact_match"], line["success"], line["pass@2"], line["pairs"]) == (1, 1, 1, 1, 4)
        assert line["score_stderr"] == 0 and line["success_stderr_bound"] == 0


def test_a_model_that_stops_past_a_length_fails_only_there(curve):
    lines = curve(3)
    assert [lines[n]["success"] for n in (2, 3, 5)] == [1, 1, 0]
    assert [lines[n]["exact_match"] for n in (2, 3, 5)] == [1, 1, 0]
    assert lines[5]["score"] == 0.5 and lines[5]["pass@2"] == 0  # half the words: 1 - 5 / 10


def test_the_line_names_its_route_seed_command_and_commit(monkeypatch, tmp_path):
    """The script end to end, with a warm start of two supervised steps built for the seed."""
    _answering(monkeypatch, None)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import length_curve

    warm = tmp_path / "warm.yaml"
    warm.write_text("data: {sft_steps: 2}\ntrainer: {max_steps: 2}\n")
    out = tmp_path / "curve.jsonl"
    argv = ["length_curve.py", "--config", str(TINY_CONFIG), "--warm", str(warm), "--warm-dir", str(tmp_path),
            "--lengths", "2", "4", "--pairs", "4", "--samples", "2", "--seeds", "3", "--out", str(out),
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    length_curve.main_()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["route"], line["seed"], line["n_words"]) for line in lines] == [("warm", 3, 2), ("warm", 3, 4)]
    assert all(line["command"].startswith("python length_curve.py --config") and line["commit"] for line in lines)
    assert lines[0]["start"].endswith(".ckpt") and lines[0]["warm_start"]["steps"] == 2
    assert not math.isnan(lines[0]["success"])

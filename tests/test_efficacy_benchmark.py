"""benchmarks/efficacy.py on the test config: an arm from configs through the CLI's parser, tested before and after,
one JSON line with its command, commit, curve and counts; an arm goes on from its checkpoint with its clock; arms and
seeds share a warm start built once; an arm of supervised steps counts their minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent


def _arm(tmp_path: Path) -> list[str]:
    overlay = tmp_path / "arm.yaml"
    data = {"stages": [4, 8], "val_pairs": 4, "curriculum": {"adaptive": {"success": 0.5}}}
    saves = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"save_last": True, "every_n_train_steps": 2, "save_top_k": 0}}  # fmt: skip
    curriculum = {"class_path": "interleave_model.run.callbacks.CurriculumCallback", "init_args": {"export": False}}
    trainer = {"max_steps": 8, "val_check_interval": 3, "callbacks": [saves, curriculum]}
    overlay.write_text(yaml.safe_dump({"trainer": trainer, "data": data}))
    return [sys.executable, "benchmarks/efficacy.py", "--config", str(TINY_CONFIG), "--config", str(overlay),
            "--minutes", "10", "--test-pairs", "4", "--samples", "2", "--bin", "2",
            "--out", str(tmp_path / "arms.jsonl"), f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip


def test_the_warm_start_digest_ignores_where_runs_write_and_how_they_show(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as running the script puts its folder first
    from efficacy import shaping_arguments

    extra = ["--trainer.default_root_dir", "/runs/a", "--model.seed", "3", "--trainer.enable_progress_bar=false"]
    assert shaping_arguments(extra) == ["--model.seed", "3"]
    assert shaping_arguments(["--trainer.default_root_dir=/runs/b", "--data.val_pairs=8"]) == ["--data.val_pairs=8"]


def test_arms_that_differ_only_in_how_they_train_share_the_start_test(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from efficacy import test_shaping

    curriculum = {"patience": 5, "adaptive": {"success": 0.75, "target": 0.5}}
    arm = {"trainer": {"logger": {"init_args": {"name": "a"}}, "precision": "bf16-mixed"},
           "model": {"optimization": {"learning_rate": 1e-4}, "sampling": {"temperature": 1.0}},
           "data": {"eval_stages": [5, 10], "curriculum": curriculum}}  # fmt: skip
    other = yaml.safe_load(yaml.safe_dump(arm))
    other["trainer"]["logger"]["init_args"]["name"] = "b"
    other["model"]["optimization"]["learning_rate"] = 3e-5
    other["data"]["curriculum"]["adaptive"]["target"] = 0.25
    other["data"]["curriculum"]["patience"] = 9
    assert test_shaping(arm) == test_shaping(other)
    assert test_shaping(arm)["trainer"] == {"precision": "bf16-mixed"}  # numerics of the test stay in the digest
    changed = yaml.safe_load(yaml.safe_dump(arm))
    changed["data"]["curriculum"]["adaptive"]["success"] = 0.9  # what pass@k counts from
    assert test_shaping(changed) != test_shaping(arm)
    changed = yaml.safe_load(yaml.safe_dump(arm))
    changed["data"]["eval_stages"] = [5]
    assert test_shaping(changed) != test_shaping(arm)
    assert test_shaping({}) == {} and test_shaping({"model": None}) == {"model": None}


def test_only_a_warm_starts_test_is_kept(monkeypatch, tmp_path):
    """A `--start` path may hold other weights later: its test runs every time and nothing is kept."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from argparse import Namespace

    from efficacy import start_test

    arm = _overlay(tmp_path / "arm.yaml", {"max_steps": 3}, {"stages": [4]})
    runs, scores = [], {"4w": {"score": 0.5}}

    def run():
        runs.append(1)
        return scores

    args = Namespace(warm=None, warm_dir=str(tmp_path), test_pairs=4, samples=2, sample_lengths=None)
    for _ in range(2):
        assert start_test(args, [str(TINY_CONFIG), arm], "start.ckpt", 0, [], run)["scores"] == scores
    assert len(runs) == 2 and not list(tmp_path.glob("start-test-*.json"))
    args.warm = "warm.yaml"  # a warm start's test runs once, then is read back
    for _ in range(2):
        assert start_test(args, [str(TINY_CONFIG), arm], "warm-0-abc.ckpt", 0, [], run)["scores"] == scores
    assert len(runs) == 3 and len(list(tmp_path.glob("start-test-*.json"))) == 1


def _run(command: list[str]) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_arm_runs_from_its_configs_and_prints_one_line(tmp_path):
    _run(_arm(tmp_path))

    (line,) = (tmp_path / "arms.jsonl").read_text().splitlines()
    arm = json.loads(line)
    assert arm["benchmark"] == "efficacy" and arm["steps"] == 8 and arm["arm"] == "arm" and not arm["supervised"]
    assert arm["command"].startswith("python benchmarks/efficacy.py")
    assert arm["commit"] and arm["configs"] == [str(TINY_CONFIG), str(tmp_path / "arm.yaml")]
    for when in ("test_start", "test_end"):
        assert set(arm[when]) == {"4w", "8w"}
        assert {"score", "score_stderr", "exact_match", "pass@1", "pass@2"} <= arm[when]["4w"].keys()
        assert {"a_accuracy", "b_accuracy", "copy_share"} <= arm[when]["4w"].keys()  # a copy's 0.5 shows as one
        assert 0.0 <= arm[when]["4w"]["copy_share"] <= 1.0
    assert [p["step"] for p in arm["curve"]] == [3, 6] and arm["curve"][0]["length"] >= 4
    assert len(arm["words"]) == 3 and all(4 <= w <= 8 for w in arm["words"])  # 6 GRPO batches in bins of 2
    assert arm["transitions"][0]["kind"] == "milestone"  # 4 words, ungated, passed at the first GRPO batch

    table = subprocess.run([sys.executable, "benchmarks/efficacy_table.py", str(tmp_path / "arms.jsonl")], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    assert table[0] == "| arm | seed | training min | steps | length at end | 4w | 8w |" and len(table) == 3
    assert table[2].startswith("| arm | 0 |") and "pass@2" in table[2]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_resumed_arm_keeps_its_clock_curve_and_start_test(tmp_path):
    """The first process ends at step 4 (as a SIGTERM pause would, saving last.ckpt); `--resume` goes on to step 8 with
    the first one's start test, curve, batches and minutes, and tests nothing again before training."""
    command = [*_arm(tmp_path), "--sample-lengths", "4"]  # pass@k at the first length only
    _run([*command, "--trainer.max_steps", "4"])
    _run([*command, "--resume"])

    first, resumed = (json.loads(line) for line in (tmp_path / "arms.jsonl").read_text().splitlines())
    assert first["steps"] == 4 and resumed["steps"] == 8
    assert resumed["test_start"] == first["test_start"]
    assert "pass@2" in resumed["test_end"]["4w"] and "pass@2" not in resumed["test_end"]["8w"]
    assert [p["step"] for p in first["curve"]] == [3] and [p["step"] for p in resumed["curve"]] == [3, 6]
    assert len(resumed["words"]) == 3  # the 2 GRPO batches before the pause are in the first bin
    assert resumed["training_minutes"] >= first["training_minutes"]
    assert resumed["eval_s"] >= first["eval_s"]
    assert resumed["fit_minutes"] >= max(first["fit_minutes"], resumed["training_minutes"])  # the whole fit, both


def _overlay(path: Path, trainer: dict, data: dict) -> str:
    path.write_text(yaml.safe_dump({"trainer": trainer, "data": data}))
    return str(path)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_arms_share_a_warm_start_built_once_and_a_supervised_arm_counts_its_minutes(tmp_path):
    """A warm start of 3 supervised steps, then a GRPO arm and an arm of supervised steps only, each from it; a second
    process with the same warm overlay reuses the saved warm start instead of training another, and its supervised
    arm stops at the budget its clock counts."""
    warm = _overlay(tmp_path / "warm.yaml", {"max_steps": 3}, {"stages": [4], "sft_steps": 3})
    grpo = _overlay(tmp_path / "grpo.yaml", {"max_steps": 3, "val_check_interval": 3}, {"stages": [4]})
    sft = _overlay(tmp_path / "sft.yaml", {"max_steps": 3, "val_check_interval": 3}, {"stages": [4], "sft_steps": 3})
    command = [sys.executable, "benchmarks/efficacy.py", "--config", str(TINY_CONFIG), "--warm", warm,
               "--warm-dir", str(tmp_path / "warm"), "--minutes", "10", "--test-pairs", "4", "--samples", "2",
               "--out", str(tmp_path / "arms.jsonl"), f"--trainer.default_root_dir={tmp_path / 'runs'}"]  # fmt: skip
    _run([*command, "--arms", grpo, sft])
    (saved,) = (tmp_path / "warm").glob("*.ckpt")
    built = saved.stat().st_mtime_ns
    tests = {path: path.stat().st_mtime_ns for path in (tmp_path / "warm").glob("start-test-*.json")}
    assert len(tests) == 2, "the arms differ in supervised steps, which shape the test: one start test each"
    # its clock ends it after one batch; another run folder and no progress bar do not shape the warm start
    _run([*command, "--arms", sft, "--seeds", "0", "--minutes", "1e-6", "--trainer.default_root_dir",
          str(tmp_path / "elsewhere"), "--trainer.enable_progress_bar=false"])  # fmt: skip

    first, second, again = (json.loads(line) for line in (tmp_path / "arms.jsonl").read_text().splitlines())
    assert [a["arm"] for a in (first, second, again)] == ["grpo", "sft", "sft"]
    assert first["warm_start"] == second["warm_start"] == again["warm_start"]
    assert first["warm_start"]["steps"] == 3 and first["warm_start"]["checkpoint"] == str(saved)
    assert saved.stat().st_mtime_ns == built  # reused, not trained again
    assert {path: path.stat().st_mtime_ns for path in tests} == tests  # the start test reused, not run again
    assert again["test_start"] == second["test_start"] and again["test_start_commit"] == second["test_start_commit"]
    assert first["test_start"] == second["test_start"]  # both arms start from the same weights
    assert not first["supervised"] and first["words"]  # GRPO batches, counted
    assert second["supervised"] and again["supervised"] and second["steps"] == 3 and again["steps"] == 1

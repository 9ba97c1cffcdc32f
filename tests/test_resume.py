"""Exact resume: N steps, a checkpoint, then N more steps equal 2N steps straight, bitwise on CPU.

The curriculum is set to move at the last batch before the checkpoint: Lightning has already fetched the next
batch at the old stage, so the resumed run must draw that batch at the old stage too.
"""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch

from cli import main
from interleave_model.algorithm.rewards import RewardFunction
from interleave_model.model.migrations import CHECKPOINT_VERSION
from tests.conftest import TINY_CONFIG, flat_settings

# threshold 0 and patience 1: the 4-word stage ends after its min_steps=2 GRPO batches (batches 2 and 3, after the
# 2 warm-start batches), so the move is decided at the end of batch 3, the last one before the checkpoint at 4.
CURRICULUM = [
    "--trainer.callbacks+=interleave_model.run.callbacks.CurriculumCallback",
    "--trainer.callbacks.export=false",
    "--data.curriculum.threshold=0.0",
    "--data.curriculum.patience=1",
    "--data.curriculum.min_steps=2",
]


class StopAfter(L.Callback):
    """Ends fit after `steps` optimizer steps, as a preempted job would: max_steps, and the LR schedule, stay as is."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def _fit(root, stop_after: int, ckpt_path=None, extra=()) -> dict:
    args = ["fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={root}", "--trainer.logger=false"]
    args += ["--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0", "--trainer.max_steps=8"]
    args += CURRICULUM + list(extra)
    args += ["--trainer.callbacks+=tests.test_resume.StopAfter", f"--trainer.callbacks.steps={stop_after}"]
    args += [f"--ckpt_path={ckpt_path}"] if ckpt_path else []
    cli = main(args)
    path = root / f"end-{stop_after}.ckpt"
    cli.trainer.save_checkpoint(path)
    return torch.load(path, weights_only=False)


def _legacy(checkpoint: dict) -> dict:
    """The checkpoint in the layout of git 35e5889 and earlier, when the curriculum's state was kept in two entries:

    checkpoint["InterleaveDataModule"] = {"stage_index": 0, "moves": [[5, 1]]}   # the stage drawn, pending moves
    checkpoint["callbacks"]["CurriculumCallback"] = {"stage_index": 1, "steps": 0, "recent": [], "above": 0,
        "collapsed": 0, "val_score": None, "temperature": None, "responses": {}, "done": False, "stopped": None,
        "history": [...]}                                                          # asdict(CurriculumState)
    checkpoint["hyper_parameters"] = {..., "temperature": 1.0, "learning_rate": 0.001, "eval_num_samples": 0, ...}
                                                                          # the model's settings, flat (no groups)
    """
    old = copy.deepcopy(checkpoint)
    del old[CHECKPOINT_VERSION]  # written before the layout's version was stamped
    old["hyper_parameters"] = flat_settings(old["hyper_parameters"])
    state = old["InterleaveDataModule"].pop("curriculum")
    drawn, moves = state.pop("drawn_index"), state.pop("moves")
    old["InterleaveDataModule"] = {"stage_index": drawn} | ({"moves": moves} if moves else {})
    state["temperature"] = old.pop("temperature")  # the rollout temperature was the curriculum's then
    old["callbacks"]["CurriculumCallback"] = state
    return old


def _assert_same(a, b, where="checkpoint"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# LoRA with dropout (kept on here) draws its masks from the global torch RNG, which the checkpoint must carry as well
LORA_DROPOUT = ["--model.lora.r=4", "--model.lora.dropout=0.5", "--model.base.disable_dropout=false"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("extra", [[], LORA_DROPOUT], ids=["full", "lora_dropout"])
def test_n_steps_resume_n_steps_equals_2n_steps_straight(tmp_path, extra):
    straight = _fit(tmp_path / "straight", 8, extra=extra)
    half = _fit(tmp_path / "split", 4, extra=extra)
    resumed = _fit(tmp_path / "split", 8, ckpt_path=tmp_path / "split" / "end-4.ckpt", extra=extra)

    # the checkpoint sits between the decision (after batch 3) and its effect (batch 5, batch 4 being in flight)
    curriculum = half["InterleaveDataModule"]["curriculum"]
    move = curriculum["history"][0]
    assert (move["kind"], move["batch"], move["from_batch"]) == ("advance", 3, 5)
    assert (curriculum["stage_index"], curriculum["drawn_index"], curriculum["moves"]) == (1, 0, [[5, 1]])
    assert "CurriculumCallback" not in half["callbacks"]  # the DataModule's entry is the only one

    assert resumed["global_step"] == straight["global_step"] == 8
    _assert_same(resumed["state_dict"], straight["state_dict"], "weights")
    _assert_same(resumed["optimizer_states"], straight["optimizer_states"], "optimizer")
    _assert_same(resumed["InterleaveDataModule"], straight["InterleaveDataModule"], "curriculum")
    _assert_same(resumed["sampling_rng"], straight["sampling_rng"], "sampling rng")
    kinds = [h["kind"] for h in straight["InterleaveDataModule"]["curriculum"]["history"]]
    assert kinds == ["advance", "done"]  # the 8-word stage was reached and trained on in both runs

    # a checkpoint of the old layout (curriculum in two entries, flat settings) resumes to the same curriculum
    # (pending move included) and the same weights
    torch.save(_legacy(half), tmp_path / "split" / "old-4.ckpt")
    from_old = _fit(tmp_path / "split", 8, ckpt_path=tmp_path / "split" / "old-4.ckpt", extra=extra)
    _assert_same(from_old["InterleaveDataModule"], straight["InterleaveDataModule"], "curriculum from the old layout")
    _assert_same(from_old["state_dict"], straight["state_dict"], "weights from the old layout")


class Succeeds(RewardFunction):
    """Every answer succeeds, so the adaptive length climbs at every GRPO batch."""

    name = "succeeds"

    def __call__(self, completions, targets, truncated):
        return [1.0] * len(completions)


# step 0.3: after GRPO batches 2, 3, 4, 5, 6, 7 the level is 4 (held at the first milestone, which passes: no held-out
# gate), 5.03, 6.32, 7.94, 9.98, 12.54 (x exp(0.3 tanh 1) = 1.2567 each); the checkpoint at 4 falls between the
# decision after batch 3 (5 words) and its effect at batch 5, batch 4 in flight at 4 words
ADAPTIVE = [
    "--data.stages=[4, 16]", "--data.replay_fraction=0.5", "--model.rewards=[tests.test_resume.Succeeds]",
    "--data.curriculum.adaptive.step=0.3", "--data.curriculum.adaptive.success=1.0",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_resume_in_the_middle_of_an_adaptive_climb_equals_the_straight_run(tmp_path):
    straight = _fit(tmp_path / "straight", 8, extra=ADAPTIVE)
    half = _fit(tmp_path / "split", 4, extra=ADAPTIVE)
    resumed = _fit(tmp_path / "split", 8, ckpt_path=tmp_path / "split" / "end-4.ckpt", extra=ADAPTIVE)

    curriculum = half["InterleaveDataModule"]["curriculum"]
    assert (curriculum["drawn_words"], curriculum["moves"]) == (4, [[5, 1, 5]])  # 5 words from batch 5 on
    assert curriculum["level"] == pytest.approx(4 * math.exp(0.3 * math.tanh(1.0)))
    _assert_same(resumed["InterleaveDataModule"], straight["InterleaveDataModule"], "curriculum")
    _assert_same(resumed["state_dict"], straight["state_dict"], "weights")
    history = straight["InterleaveDataModule"]["curriculum"]["history"]
    assert [(h["kind"], h["from_words"]) for h in history] == [("milestone", 4)]
    level = straight["InterleaveDataModule"]["curriculum"]["level"]
    assert level == pytest.approx(4 * math.exp(0.3 * math.tanh(1.0)) ** 5)  # 12.54: the climb went on after it

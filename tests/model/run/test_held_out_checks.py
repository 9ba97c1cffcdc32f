"""Held-out checks in proportion, under a real Trainer: a tiny model's curriculum passes the same milestones at the same
steps, on the same scores, whether each check runs every length or only those that decide something; each check's
cost is logged (`time/val_s`)."""

from __future__ import annotations

import json

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from interleave_data.curriculum_types import CurriculumSettings
from interleave_data.length_schedule import AdaptiveLength
from interleave_model.run.callbacks import CurriculumCallback


class _Checks(L.Callback):
    """Each check's step, the milestone it worked towards and its table (`{n_words: every measure}`, as JSON: the
    answers of an untrained model score 0, their lengths and where they went wrong do not); its cost."""

    def __init__(self) -> None:
        self.checks: list[tuple[int, int, dict[int, str]]] = []
        self.seconds: list[float] = []

    def on_validation_end(self, trainer, pl_module):  # before the CurriculumCallback's: the milestone as checked
        table = {row["n_words"]: json.dumps(row, sort_keys=True) for row in pl_module.eval_results["lengths"]}
        self.checks.append((trainer.global_step, trainer.datamodule.curriculum.stage_words, table))
        self.seconds.append(float(trainer.callback_metrics["time/val_s"]))


def _climb(make_module, make_datamodule, eval_every_length: bool, callbacks: tuple = ()):
    """Milestones 3, 4 and 6 words (6 gated out of reach), a 3-step warm start on 2 and 3 words, held-out checks every
    2 steps to step 10; `callbacks` join the run. Returns the checks and the curriculum's history."""
    module = make_module()
    settings = CurriculumSettings(adaptive=AdaptiveLength(), val_threshold=[0.0, 0.0, 1.0])
    dm = make_datamodule(module.tokenizer, stages=(3, 4, 6), eval_stages=(2, 3, 4, 6), sft_stages=(2, 3),
                         sft_steps=3, curriculum=settings, eval_every_length=eval_every_length)  # fmt: skip
    checks = _Checks()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=10, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
        callbacks=[checks, CurriculumCallback(export=False), *callbacks],
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    return checks, dm.curriculum.state.history


def test_the_milestones_pass_as_when_every_check_ran_every_length(make_module, make_datamodule):
    every, every_history = _climb(make_module, make_datamodule, eval_every_length=True)
    checks, history = _climb(make_module, make_datamodule, eval_every_length=False)

    assert [sorted(table) for _, _, table in every.checks] == [[2, 3, 4, 6]] * 5
    # step 2 in the warm start (its lengths; 3 its gate), 4 the whole curve after 3 words passed, 6 after 4 words
    # passed, 8 towards 6 words with 3 and 4 passed, 10 the end of fit
    assert [(step, sorted(table)) for step, _, table in checks.checks] == [
        (2, [2, 3]), (4, [2, 3, 4, 6]), (6, [2, 3, 4, 6]), (8, [3, 4, 6]), (10, [2, 3, 4, 6])
    ]  # fmt: skip
    passed = [(h["kind"], h["from_words"], h["global_step"]) for h in history]
    assert passed == [("milestone", 3, 2), ("milestone", 4, 4)]
    assert history == every_history
    for (step, words, table), (same_step, same_words, whole) in zip(checks.checks, every.checks, strict=True):
        assert (step, words) == (same_step, same_words)
        assert table == {n: whole[n] for n in table}  # each length's answers, to the same pairs
    assert all(seconds > 0 for seconds in checks.seconds + every.seconds)


def test_a_length_a_checkpoint_monitors_runs_at_every_check(make_module, make_datamodule, tmp_path):
    """A checkpoint kept by the 2-word score (a length the climb stops checking once the warm start ends) reads a new
    value at every check, not the last one logged (a stale score would keep or drop checkpoints)."""
    keep = ModelCheckpoint(dirpath=tmp_path, monitor="val/alignment_2w", mode="max", save_top_k=1)
    checks, _ = _climb(make_module, make_datamodule, eval_every_length=False, callbacks=(keep,))
    assert [(step, sorted(table)) for step, _, table in checks.checks] == [
        (2, [2, 3]), (4, [2, 3, 4, 6]), (6, [2, 3, 4, 6]), (8, [2, 3, 4, 6]), (10, [2, 3, 4, 6])
    ]  # fmt: skip
    assert keep.best_model_path and keep.best_model_score is not None

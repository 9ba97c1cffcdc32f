"""Which lengths a held-out check of fit runs (`InterleaveDataModule.held_out_lengths`), and that a length it runs is
served the batches it always was.

A stand-in trainer carries what the choice reads (the command, the step, a stop); the curriculum passes its
milestones through its own decision (`observe_milestone`), as the CurriculumCallback has it do.
"""

from types import SimpleNamespace

from interleave_data.curriculum_types import CurriculumSettings
from interleave_data.datamodule import InterleaveDataModule
from interleave_data.held_out import checked_lengths
from interleave_data.length_schedule import AdaptiveLength

STAGES, EVAL = [10, 25, 50], [4, 10, 25, 50]


def _dm(tmp_path, tokenizer=None, **kwargs) -> InterleaveDataModule:
    """Milestones 10, 25, 50 passed on held-out scores, a 4-step warm start on 4 and 10 words, evaluated at 4 too."""
    args = {"stages": STAGES, "eval_stages": EVAL, "sft_stages": [4, 10], "sft_steps": 4, "train_pairs": 8,
            "val_pairs": 6, "test_pairs": 2, "eval_batch_size": 4, "cache_dir": str(tmp_path / "cache"),
            "curriculum": CurriculumSettings(adaptive=AdaptiveLength(), val_threshold=0.9)}  # fmt: skip
    dm = InterleaveDataModule(**(args | kwargs), tokenizer=tokenizer)
    dm.prepare_data()
    dm.setup("fit")
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), should_stop=False, sanity_checking=False,
                                 global_step=0, max_steps=100, global_rank=0)  # fmt: skip
    return dm


def _check(dm: InterleaveDataModule, batches_run: int) -> list[int]:
    """The lengths of a check after `batches_run` batches (one batch is one step here)."""
    dm._batches_run = dm.trainer.global_step = batches_run
    return dm.held_out_lengths()


def test_a_check_runs_the_lengths_that_decide_something_and_the_whole_curve_where_it_is_read(tmp_path):
    dm = _dm(tmp_path)
    curriculum = dm.curriculum

    assert _check(dm, 2) == [4, 10]  # the warm start: the lengths it trains on; 10 is also its gate
    assert _check(dm, 4) == EVAL  # its last check, as GRPO starts: the curve GRPO's gains are read against
    assert _check(dm, 6) == [10]  # the climb towards the first milestone
    curriculum.observe_milestone(0.95, 5, 6)  # as the check at step 6 ends: 10 words passed
    assert dm.held_out_lengths() == [10]  # a check's lengths are chosen once, as it starts
    assert _check(dm, 8) == EVAL  # the check after a milestone passed: the whole curve
    assert _check(dm, 10) == [10, 25]  # towards 25 words, and 10 passed: replay keeps it
    curriculum.observe_milestone(0.5, 9, 10)  # 25 words not passed
    assert _check(dm, 12) == [10, 25]
    curriculum.observe_milestone(0.95, 11, 12)
    assert _check(dm, 14) == EVAL and _check(dm, 16) == [10, 25, 50]  # one whole curve per milestone passed
    dm.trainer.max_steps = 18
    assert _check(dm, 18) == EVAL  # the check at max_steps ends fit
    dm.trainer.max_steps, dm.trainer.should_stop = 100, True
    assert _check(dm, 20) == EVAL  # so does the check of a run told to stop (the last milestone passed, a stop)


def test_a_sanity_check_leaves_the_curve_owed_and_a_resume_keeps_it_owed(tmp_path):
    dm = _dm(tmp_path, sft_steps=0)
    dm.curriculum.observe_milestone(0.95, 3, 4)
    saved = dm.state_dict()

    dm.trainer.sanity_checking = True
    assert _check(dm, 4) == EVAL
    dm.trainer.sanity_checking = False
    assert _check(dm, 6) == EVAL and _check(dm, 8) == [10, 25]

    resumed = _dm(tmp_path, sft_steps=0)
    resumed.load_state_dict(saved)
    assert _check(resumed, 6) == EVAL and _check(resumed, 8) == [10, 25]
    old = {key: value for key, value in saved.items() if key != "curve_passes"}  # a checkpoint from before the count
    resumed.load_state_dict(old)
    assert _check(resumed, 6) == [10, 25]


def test_every_length_at_every_check_when_asked_and_outside_fit(tmp_path):
    dm = _dm(tmp_path, eval_every_length=True)
    assert _check(dm, 2) == _check(dm, 6) == EVAL

    dm = _dm(tmp_path)
    dm.trainer.state.fn = "validate"
    assert _check(dm, 2) == EVAL
    dm.trainer = None
    assert dm.held_out_lengths() == EVAL


def test_a_check_that_nothing_decides_runs_every_length():
    assert checked_lengths([25, 50], {4, 10}, whole=False) == [25, 50]
    assert checked_lengths([10, 25, 50], {10}, whole=False) == [10]
    assert checked_lengths([10, 25, 50], {10}, whole=True) == [10, 25, 50]


def test_a_length_a_check_runs_gets_the_batches_it_always_got_and_one_it_skips_gets_none(tmp_path, tokenizer):
    dm = _dm(tmp_path, tokenizer)
    loaders = dm.val_dataloader()
    every = [dm._eval_loader(dm.examples(n, "val")) for n in EVAL]  # a plain loader of each length's pairs

    dm._batches_run = 6  # the climb towards 10 words: only 10 runs
    served = [[batch["ids"] for batch in loader] for loader in loaders]

    assert [len(loader) for loader in loaders] == [len(loader) for loader in every] == [2] * 4
    assert served == [[], [batch["ids"] for batch in every[1]], [], []]
    assert served[1] == [[e.id for e in dm.examples(10, "val")[:4]], [e.id for e in dm.examples(10, "val")[4:]]]

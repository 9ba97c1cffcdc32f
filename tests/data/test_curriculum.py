"""The curriculum's decisions without a trainer: each test feeds `StepCounts` and reads the `Decision`s.

`_feed` numbers the batches from `first` as a run would: batch k is decided after it ran, and a move takes effect
at k + 2 (Lightning has fetched k + 1 already).
"""

import pytest

from interleave_data.corpus import CorpusError
from interleave_data.curriculum import Curriculum, split_stage
from interleave_data.curriculum_types import (
    CurriculumSettings,
    Decision,
    SmallerStep,
    StepCounts,
    StopAdvice,
    check_lengths,
)
from interleave_data.length_schedule import AdaptiveLength


def _curriculum(stages=(4, 8, 16), **settings) -> Curriculum:
    return Curriculum(stages, settings=CurriculumSettings(**({"window": 1} | settings)))


def _feed(curriculum: Curriculum, rewards: list[float], stuck=0.0, temperature=1.0, first=0) -> list[Decision]:
    """One decision per batch of this mean reward (and this share of stuck groups, all of them zero-variance)."""
    decisions = []
    for k, reward in enumerate(rewards, start=first):
        counts = StepCounts(reward, stuck, stuck, 1.0, temperature, batch=k, next_batch=k + 2, global_step=k + 1)
        decisions.append(curriculum.observe(counts))
        temperature = decisions[-1].temperature or temperature
    return decisions


def test_advances_after_min_steps_and_patience_batches_above_the_threshold():
    curriculum = _curriculum(threshold=0.8, patience=2, min_steps=4)

    decisions = _feed(curriculum, [0.9, 0.9, 0.5, 0.9])  # the dip restarts the count; 4 steps, above only 1
    assert [d.kind for d in decisions] == ["none"] * 4
    (advance,) = _feed(curriculum, [0.9])

    assert (advance.kind, advance.stage_index, advance.export_words, advance.stop) == ("advance", 1, 4, False)
    assert advance.message.startswith("advance: 4 -> 8 words") and curriculum.stage_words == 8
    assert curriculum.state.steps == curriculum.state.above == 0 and curriculum.state.recent == []
    assert curriculum.state.moves == [[curriculum.state.history[-1]["from_batch"], 1]]


def test_rolling_mean_over_the_window():
    curriculum = _curriculum(threshold=0.8, patience=1, min_steps=0, window=2)

    assert [d.kind for d in _feed(curriculum, [0.6, 1.0])] == ["none", "advance"]  # (0.6 + 1.0) / 2 = 0.8
    assert _feed(curriculum, [0.4])[0].rolling == 0.4  # the window restarts at the new stage


def test_validation_score_gates_the_move():
    curriculum = _curriculum(threshold=0.5, patience=1, min_steps=0, val_threshold=0.7)

    assert _feed(curriculum, [0.9])[0].kind == "none"  # no score yet
    curriculum.observe_validation(0.6)
    assert _feed(curriculum, [0.9])[0].kind == "none"
    curriculum.observe_validation(0.75)
    assert _feed(curriculum, [0.9])[0].kind == "advance"
    assert curriculum.state.val_score is None  # a new length needs a score of its own


def test_warm_start_ends_at_the_first_validation_that_reaches_its_score():
    curriculum = Curriculum([10, 20], settings=CurriculumSettings(warm_start_until=0.5), sft_steps=100)
    assert curriculum.warm_start(99) and not curriculum.warm_start(100)  # until a score ends it: all sft_steps

    assert curriculum.observe_validation(0.4, next_batch=30, global_step=28) == ""
    assert curriculum.warm_start(99)
    message = curriculum.observe_validation(0.55, next_batch=52, global_step=50)
    # the batch after the validation is fetched already: GRPO from the one after it
    assert curriculum.warm_start(51) and not curriculum.warm_start(52) and not curriculum.warm_start(99)
    assert message == (
        "curriculum: the warm-start ends at step 50 (held-out score 0.550 >= warm_start_until 0.5); GRPO from batch 52"
    )
    assert curriculum.state.history[-1] | {"why": ""} == {
        "kind": "warm_start_end", "from_words": 10, "to_words": 10, "batch": 51, "global_step": 50, "why": "",
    }  # fmt: skip
    assert curriculum.observe_validation(0.9, next_batch=60) == "" and curriculum.state.warm_end == 52  # once

    restored = Curriculum([10, 20], settings=CurriculumSettings(warm_start_until=0.5), sft_steps=100)
    restored.load_state_dict(curriculum.state_dict())
    assert restored.warm_start(51) and not restored.warm_start(52)


def test_without_warm_start_until_or_after_the_warm_start_a_score_changes_nothing():
    plain = Curriculum([10], sft_steps=100)
    assert plain.observe_validation(1.0, next_batch=5) == "" and plain.warm_start(99)
    late = Curriculum([10], settings=CurriculumSettings(warm_start_until=0.5), sft_steps=100)
    assert late.observe_validation(0.9, next_batch=100) == "" and late.state.warm_end is None  # GRPO already


def test_last_stage_learned_is_done_and_stops_only_when_asked():
    for stop_when_done in (False, True):
        curriculum = _curriculum((4,), threshold=0.5, patience=1, min_steps=0, stop_when_done=stop_when_done)
        (done,) = _feed(curriculum, [0.9])
        assert (done.kind, done.export_words, done.stop, curriculum.done) == ("done", 4, stop_when_done, True)


def test_raise_temperature_up_to_the_cap_then_stop():
    curriculum = _curriculum(collapse_share=0.5, collapse_patience=2, temperature_step=0.3, max_temperature=1.5)

    decisions = _feed(curriculum, [0.0] * 6, stuck=0.5)

    # 1.0 -> 1.3 -> 1.5 (capped); at the cap no raise is left
    kinds = [(d.kind, d.temperature) for d in decisions]
    assert kinds[1::2] == [("raise_temperature", 1.3), ("raise_temperature", 1.5), ("stop", None)]
    advice = decisions[-1].advice
    assert "max_temperature=1.5" in advice.why
    assert not any("temperature" in change for change in advice.others)  # the cap's stop asks for no hotter sampling


def test_collapse_responses_are_capped_per_length():
    curriculum = _curriculum(collapse_patience=1, temperature_step=0.1, max_temperature=5.0, max_collapse_responses=2)

    decisions = _feed(curriculum, [0.0] * 3, stuck=1.0)

    assert [d.kind for d in decisions] == ["raise_temperature", "raise_temperature", "stop"]
    assert "2 responses at this length did not help" in decisions[-1].advice.why
    assert curriculum.state.responses == {4: 3}


def test_step_back_moves_to_the_previous_stage_and_stops_at_the_first():
    curriculum = _curriculum(threshold=0.5, patience=1, min_steps=0, collapse_patience=1, on_collapse="step_back")

    assert _feed(curriculum, [0.9])[0].kind == "advance"
    (back,) = _feed(curriculum, [0.0], stuck=1.0)
    assert (back.kind, back.stage_index, back.export_words) == ("step_back", 0, None)
    (stop,) = _feed(curriculum, [0.0], stuck=1.0)

    assert stop.kind == "stop" and stop.stop and "no earlier stage" in stop.advice.why
    assert [h["kind"] for h in curriculum.state.history] == ["advance", "step_back"]  # the stop: once it is worded


def test_a_stop_is_data_until_the_run_words_it_and_records_the_line():
    curriculum = _curriculum(collapse_patience=1, on_collapse="stop")
    (stop,) = _feed(curriculum, [0.0], stuck=1.0)
    assert (stop.message, curriculum.state.stopped, curriculum.state.history) == ("", None, [])

    counts = StepCounts(0.0, 1.0, 1.0, 1.0, 1.0, batch=0, next_batch=2, global_step=1)
    line = curriculum.record_stop("curriculum: stopping, the words the run gave it.", counts)

    assert line == "stop: 4 -> 4 words at step 1 (curriculum: stopping, the words the run gave it.)"
    assert curriculum.state.stopped == "curriculum: stopping, the words the run gave it."
    assert curriculum.state.history == [
        {"kind": "stop", "from_words": 4, "to_words": 4, "batch": 0, "global_step": 1, "why": curriculum.state.stopped}
    ]


def test_a_collapse_stop_advises_resuming_from_the_last_learned_stage_then_a_response():
    curriculum = _curriculum(threshold=0.5, patience=1, min_steps=0, collapse_patience=1, on_collapse="stop")

    _feed(curriculum, [0.9])
    (stop,) = _feed(curriculum, [0.0], stuck=1.0)

    assert stop.advice == StopAdvice(
        why="collapse at 8 words: stuck groups (all G rewards equal, below 0.5) made up >= 80% of the batch for 1 "
        "batches (reward 0.000), and on_collapse is 'stop'",
        smaller_step=SmallerStep(stages=[6, 8, 16], per_stage={}, learned_words=4),
        others=(
            "a response to a collapse instead of the stop (on_collapse: raise_temperature or step_back)",
            "a supervised warm-start at 8 words (data.sft_stages, data.sft_steps)",
        ),
    )
    assert not stop.advice.smaller_step.rerun
    hot = _curriculum(collapse_patience=1, on_collapse="stop", max_temperature=1.0)
    (hot_stop,) = _feed(hot, [0.0], stuck=1.0, temperature=1.0)
    assert hot_stop.advice.others[0].endswith("(on_collapse: step_back)")  # no raise left at the temperature cap


def test_a_plateau_stops_after_plateau_steps_batches_without_a_gain_over_full_windows():
    curriculum = _curriculum(window=2, plateau_steps=3)

    # batch 0 fills half the window: its 1.0 sets no best; batch 1's 0.75 does, and 3 batches without a gain follow
    decisions = _feed(curriculum, [1.0, 0.5, 0.5, 0.5, 0.5])

    assert [d.kind for d in decisions] == ["none"] * 4 + ["stop"] and decisions[-1].stop
    assert decisions[-1].advice == StopAdvice(
        why="no gain over 0.01 in the rolling reward at 4 words for 3 batches, the plateau_steps (now 0.500, best "
        "0.750)",
        smaller_step=SmallerStep(stages=[2, 4, 8, 16], per_stage={}, learned_words=None),  # 2 inserted before 4
        others=("a supervised warm-start at 4 words (data.sft_stages, data.sft_steps)",),
    )
    assert decisions[-1].advice.smaller_step.rerun  # the first stage stopped: nothing learned to resume from


def test_only_a_gain_over_plateau_gain_restarts_the_plateau_count():
    curriculum = _curriculum(plateau_steps=3, plateau_gain=0.01)

    # 0.505 is no gain over 0.5 + 0.01; 0.52 is, and 3 more batches without one stop the run
    decisions = _feed(curriculum, [0.5, 0.5, 0.505, 0.52, 0.5, 0.5, 0.5])

    assert [d.kind for d in decisions] == ["none"] * 6 + ["stop"]
    assert (curriculum.state.best, curriculum.state.since_best) == (0.52, 3)


def test_max_stage_steps_stops_a_stage_and_each_stage_counts_its_own_batches():
    curriculum = _curriculum(threshold=0.5, patience=1, min_steps=0, max_stage_steps=[3, 5, None])

    assert _feed(curriculum, [0.4, 0.9])[-1].kind == "advance"  # 2 batches at 4 words, under its cap of 3
    decisions = _feed(curriculum, [0.4, 0.45, 0.3, 0.3, 0.3], first=2)

    assert [d.kind for d in decisions] == ["none"] * 4 + ["stop"]
    advice = decisions[-1].advice
    assert advice.why == ("5 batches at 8 words, the stage's max_stage_steps (rolling reward now 0.300, best 0.450, "
                          "last gain 3 batches ago)")  # fmt: skip
    # the 8-word stage's cap of 5 goes to the 6 words inserted before it as well
    assert advice.smaller_step == SmallerStep([6, 8, 16], {"max_stage_steps": [5, 5, None]}, learned_words=4)
    assert advice.others == (
        "a larger max_stage_steps if the reward was still rising",
        "a supervised warm-start at 8 words (data.sft_stages, data.sft_steps)",
    )


def test_the_stop_advises_resuming_with_a_length_between_the_learned_stage_and_this_one():
    thresholds = [0.9, 0.9, 0.85, 0.8]
    settings = {"threshold": thresholds, "patience": 1, "min_steps": 0, "plateau_steps": 2}
    curriculum = _curriculum((10, 25, 50, 100), **settings)

    stop = _feed(curriculum, [0.95, 0.95, 0.5, 0.5, 0.5])[-1]  # 10 and 25 words learned, then no gain at 50

    step = stop.advice.smaller_step
    assert step == SmallerStep(stages=[37, 50, 100], per_stage={"threshold": [0.85, 0.85, 0.8]}, learned_words=25)
    # the advised lists fit together: a curriculum takes them as they are
    resumed = Curriculum(step.stages, settings=CurriculumSettings(**step.per_stage))
    assert resumed.thresholds == [0.85, 0.85, 0.8]


@pytest.mark.parametrize(
    ("stages", "index", "split"),
    [([10, 25, 50], 1, [17, 25, 50]), ([10, 25, 50], 0, [5, 10, 25, 50]), ([4, 5], 1, None), ([1, 2], 0, None)],
)
def test_split_stage_inserts_the_whole_length_halfway_to_the_stage_before(stages, index, split):
    assert split_stage(stages, index) == split


def test_under_the_adaptive_schedule_a_longer_length_is_a_gain_and_each_milestone_counts_afresh():
    rule = AdaptiveLength(success=0.9, target=0.5, step=0.05)
    settings = CurriculumSettings(window=1, adaptive=rule, plateau_steps=2)
    curriculum = Curriculum((10, 25, 50), settings=settings)

    def feed(rates):
        return [curriculum.observe(StepCounts(r, 0.0, 0.0, 1.0, 1.0, k, k + 2, k + 1, success_rate=r)) for k, r in
                enumerate(rates)]  # fmt: skip

    # every sample succeeds: the length climbs ~4% a batch, so no two batches in a row stay at one length; 10 words
    # passes at once (the length starts there), 25 words on the way
    kinds = [d.kind for d in feed([1.0] * 30)]
    assert "stop" not in kinds and kinds.count("milestone") == 2 and curriculum.stage_words == 50
    assert curriculum.state.steps == 30 - 1 - kinds.index("milestone", 1)  # counted from the last milestone on
    # at the target the length holds, and the reward does not rise: two batches, then the stop
    held = feed([0.5] * 3)
    assert [d.kind for d in held] == ["none", "none", "stop"]
    length, advice = curriculum.length, held[-1].advice
    assert f"at {length} words and no longer length towards the 50-word milestone for 2 batches" in advice.why
    # the adaptive length moves in small steps already: no smaller step inserts a milestone, which would start it higher
    assert advice.smaller_step is None
    assert advice.others == (f"a supervised warm-start at {length} words (data.sft_stages, data.sft_steps)",)


def test_state_round_trip_mid_stage_gives_the_same_later_decisions():
    settings = {"threshold": 0.5, "patience": 3, "min_steps": 0, "collapse_patience": 2, "window": 2}
    straight = _curriculum(**settings)
    _feed(straight, [0.0, 0.0], stuck=1.0)  # a temperature raise
    _feed(straight, [0.9, 0.9])
    restored = _curriculum(**settings)
    restored.load_state_dict(straight.state_dict())

    later = [0.9, 0.2, 0.9, 0.9, 0.9]
    assert _feed(restored, later, temperature=1.25, first=4) == _feed(straight, later, temperature=1.25, first=4)
    assert restored.state == straight.state  # the first 0.9 is the third above the threshold: an advance at once
    assert [h["kind"] for h in restored.state.history] == ["raise_temperature", "advance", "advance"]


def test_the_plateau_count_round_trips_and_a_state_saved_before_it_loads():
    straight = _curriculum(plateau_steps=4)
    _feed(straight, [0.5, 0.6, 0.6])
    saved = straight.state_dict()
    assert (saved["best"], saved["best_words"], saved["since_best"]) == (0.6, 4, 1)

    restored = _curriculum(plateau_steps=4)
    restored.load_state_dict(saved)
    decisions = _feed(restored, [0.6] * 3, first=3)
    assert decisions == _feed(straight, [0.6] * 3, first=3) and decisions[-1].kind == "stop"
    assert restored.state == straight.state

    old = {k: v for k, v in saved.items() if k not in ("best", "best_words", "since_best")}  # written before them
    before = _curriculum(plateau_steps=4)
    before.load_state_dict(old)
    assert (before.state.best, before.state.since_best) == (None, 0)
    assert [d.kind for d in _feed(before, [0.6] * 5, first=3)] == ["none"] * 4 + ["stop"]  # counts from its next batch


def test_pending_moves_apply_at_their_batch():
    curriculum = _curriculum()
    curriculum.move(1, from_batch=3)
    curriculum.move(2, from_batch=5)

    assert [curriculum.draw_length(k) for k in range(7)] == [4, 4, 4, 8, 8, 16, 16]
    assert curriculum.stage_words == 16 and curriculum.state.moves == []


def test_replay_leaves_one_prompt_at_the_stage_and_none_at_the_first():
    curriculum = Curriculum([4, 8], replay_fraction=0.9)

    assert curriculum.replayed(4) == 0
    curriculum.move(1)
    assert curriculum.replayed(4) == 3 and curriculum.replayed(1) == 0


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([], "at least one length"),
        ([10, 10], "strictly increasing, got 10 10"),
        ([25, 10], "strictly increasing, got 25 10"),
        ([0, 10], "positive integer, got 0"),
        ([10, 2.5], "positive integer, got 2.5"),
        ([True], "positive integer, got True"),
    ],
)
def test_bad_lengths_are_named(lengths, message):
    with pytest.raises(CorpusError, match=message):
        check_lengths(lengths, "stages")
    with pytest.raises(CorpusError, match=message):
        Curriculum(lengths)


@pytest.mark.parametrize(
    "settings",
    [
        {"threshold": 1.5},
        {"threshold": [0.5]},
        {"patience": 0},
        {"min_steps": -1},
        {"window": 0},
        {"collapse_share": 0.0},
        {"on_collapse": "panic"},
        {"warm_start_until": 0.0},
        {"warm_start_until": 1.5},
        {"plateau_steps": 0},
        {"plateau_gain": -0.1},
        {"plateau_gain": 1.5},
        {"max_stage_steps": 0},
        {"max_stage_steps": [5, 0]},
        {"max_stage_steps": [5]},
    ],
)
def test_bad_settings_are_refused(settings):
    with pytest.raises(CorpusError):
        Curriculum([10, 20], settings=CurriculumSettings(**settings))


@pytest.mark.parametrize("replay_fraction", [-0.1, 1.0])
def test_replay_fraction_must_leave_room_for_the_current_stage(replay_fraction):
    with pytest.raises(CorpusError, match="replay_fraction"):
        Curriculum([10, 20], replay_fraction=replay_fraction)

"""The adaptive length (AdaRFT's rule) and the milestones, without a trainer: feed `StepCounts`, read the state.

As in test_curriculum.py, batch k is decided after it ran and a move takes effect at k + 2.
"""

import math

import pytest

from interleave_data.corpus import CorpusError
from interleave_data.curriculum import Curriculum
from interleave_data.curriculum_types import CurriculumSettings, StepCounts
from interleave_data.length_schedule import AdaptiveLength, next_level, replay_range, words_of

RULE = AdaptiveLength(success=0.9, target=0.5, step=0.05)


def test_next_level_is_adarft_on_the_log_length():
    # 20 * exp(0.05 * tanh(2 * 0.5)) = 20 * exp(0.05 * 0.76159) = 20 * 1.03880 = 20.776
    assert next_level(20.0, 1.0, RULE, 10, 50) == pytest.approx(20.776, abs=1e-3)
    assert next_level(20.0, 0.5, RULE, 10, 50) == 20.0  # at the target: stays
    assert next_level(20.0, 0.0, RULE, 10, 50) == pytest.approx(20 / 1.03880, abs=1e-3)  # 19.253
    assert next_level(10.2, 0.0, RULE, 10, 50) == 10.0 and next_level(49.9, 1.0, RULE, 10, 50) == 50.0  # clipped


def test_words_round_half_up_and_replay_spans_the_lengths_below():
    assert [words_of(x) for x in (10.0, 10.49, 10.5, 11.2)] == [10, 10, 11, 11]
    assert list(replay_range(30, 10, 0.5)) == list(range(15, 30))
    assert list(replay_range(12, 10, 0.5)) == [10, 11] and list(replay_range(10, 10, 0.5)) == []


@pytest.mark.parametrize(
    "settings",
    [
        {"success": 0.0},
        {"target": 1.0},
        {"step": 0.0},
    ],
)
def test_bad_settings_are_refused_by_name(settings):
    with pytest.raises(CorpusError, match="curriculum.adaptive"):
        AdaptiveLength(**settings)


def _adaptive(stages=(10, 25, 50), val_threshold=None, **settings) -> Curriculum:
    s = CurriculumSettings(window=4, adaptive=RULE, val_threshold=val_threshold, **settings)
    return Curriculum(stages, replay_fraction=0.5, settings=s)


def _feed(curriculum: Curriculum, rates: list[float], first: int = 0, stuck: float = 0.0):
    decisions = []
    for k, rate in enumerate(rates, start=first):
        counts = StepCounts(rate, stuck, stuck, 1.0, 1.0, batch=k, next_batch=k + 2, global_step=k + 1,
                            success_rate=rate)  # fmt: skip
        decisions.append(curriculum.observe(counts))
    return decisions


def test_the_length_climbs_while_samples_succeed_and_falls_when_they_fail():
    curriculum = _adaptive(val_threshold=0.9)
    assert (curriculum.length, curriculum.stage_words) == (10, 10)

    _feed(curriculum, [1.0] * 30)  # capped at the first milestone until its held-out score passes it
    assert curriculum.length == 10 and curriculum.state.level == 10.0

    passed = curriculum.observe_milestone(0.95, batch=29, global_step=30)
    assert (passed.kind, passed.export_words, curriculum.stage_words) == ("milestone", 10, 25)
    assert passed.message.startswith("milestone: 10 -> 25 words")

    _feed(curriculum, [1.0] * 10, first=30)  # each batch at most exp(0.038): 10 * 1.0388^10 = 14.6
    assert curriculum.state.level == pytest.approx(10 * math.exp(0.05 * math.tanh(1.0)) ** 10)
    assert curriculum.length == 15
    _feed(curriculum, [0.0] * 3, first=40)
    assert curriculum.length == 13  # 14.6 / 1.0388^3 = 13.0
    _feed(curriculum, [1.0] * 100, first=43)
    assert curriculum.length == 25  # never past the milestone not yet passed


def test_partial_credit_without_a_success_holds_the_length():
    """Samples scoring 0.8 on average, none of them 0.9: the success share (0) holds the length at the first milestone
    (AdaRFT's mean reward would have climbed, onto answers worth half: RESULTS, "Tried and dropped")."""
    rule = AdaptiveLength(success=0.9, target=0.5, step=0.05)
    curriculum = Curriculum((10, 25), settings=CurriculumSettings(window=4, adaptive=rule))
    for k in range(10):
        curriculum.observe(StepCounts(0.8, 0.0, 0.0, 1.0, 1.0, batch=k, next_batch=k + 2, global_step=k + 1,
                                      success_rate=0.0))  # fmt: skip
    assert curriculum.stage_words == 25  # the ungated 10-word milestone passed at the first batch
    assert curriculum.state.level == pytest.approx(10.0)


def test_moves_take_effect_two_batches_later_and_the_stream_reads_them():
    curriculum = _adaptive()
    # levels 10 (held at the first milestone, which then passes: no held-out gate), 10.39, 10.79: lengths 10, 10, 11
    _feed(curriculum, [1.0] * 3)
    assert curriculum.state.moves == [[4, 1, 11]]  # decided after batch 2, drawn from batch 4 on
    assert [curriculum.draw_length(k) for k in range(6)] == [10, 10, 10, 10, 11, 11]
    assert list(curriculum.replay_lengths()) == [10] and curriculum.replayed(4) == 2


def test_without_a_held_out_gate_a_milestone_passes_when_the_length_reaches_it():
    curriculum = _adaptive(stages=(10, 12), stop_when_done=True)
    decisions = _feed(curriculum, [1.0] * 12)
    moved = [d for d in decisions if d.kind != "none"]
    assert [d.kind for d in moved] == ["milestone", "done"] and moved[-1].stop and curriculum.done
    assert [h["kind"] for h in curriculum.state.history] == ["milestone", "done"]


def test_a_collapse_steps_back_to_the_milestone_below():
    curriculum = _adaptive(on_collapse="step_back", collapse_patience=2, stages=(10, 25, 50))
    _feed(curriculum, [1.0] * 40)
    assert curriculum.stage_words == 50 and curriculum.length > 25
    (_, back) = _feed(curriculum, [0.2, 0.2], first=40, stuck=1.0)
    assert back.kind == "step_back" and curriculum.length == 25 and curriculum.state.level == 25.0


def test_state_round_trips_in_the_middle_of_a_climb():
    straight = _adaptive(val_threshold=[0.8, 0.8, 0.8])
    straight.observe_milestone(0.85, batch=0, global_step=1)
    _feed(straight, [1.0, 0.75, 0.9, 0.25], first=1)
    restored = _adaptive(val_threshold=[0.8, 0.8, 0.8])
    restored.load_state_dict(straight.state_dict())
    assert restored.state == straight.state

    later = [1.0, 0.6, 0.0, 1.0, 1.0]
    assert _feed(restored, later, first=5) == _feed(straight, later, first=5)
    assert restored.state == straight.state and restored.length == straight.length


def test_a_fixed_stage_checkpoint_is_not_resumed_as_adaptive():
    fixed = Curriculum((10, 25))
    with pytest.raises(CorpusError, match="trained on fixed stages"):
        _adaptive(stages=(10, 25)).load_state_dict(fixed.state_dict())

import pytest

from interleave_data.corpus import CorpusError
from interleave_data.curriculum import Curriculum, Stage, check_lengths


def test_curriculum_from_lengths_shares_stage_settings():
    curriculum = Curriculum.from_lengths([10, 25, 50], replay_fraction=0.25, threshold=0.8, patience=5)

    assert curriculum.lengths == [10, 25, 50]
    assert all(stage.threshold == 0.8 and stage.patience == 5 for stage in curriculum.stages)
    assert curriculum.stages[0].min_steps == Stage(1).min_steps
    with pytest.raises(CorpusError, match="strictly increasing, got 25 10"):
        Curriculum((Stage(25), Stage(10)))


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
        Curriculum.from_lengths(lengths)


@pytest.mark.parametrize(
    "kwargs", [{"threshold": 1.5}, {"threshold": -0.1}, {"patience": 0}, {"min_steps": -1}, {"n_words": -3}]
)
def test_bad_stage_settings_are_refused(kwargs):
    with pytest.raises(CorpusError):
        Stage(**{"n_words": 10, **kwargs})


@pytest.mark.parametrize("replay_fraction", [-0.1, 1.0])
def test_replay_fraction_must_leave_room_for_the_current_stage(replay_fraction):
    with pytest.raises(CorpusError, match="replay_fraction"):
        Curriculum.from_lengths([10, 20], replay_fraction=replay_fraction)

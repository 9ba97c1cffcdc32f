"""Each migration on a minimal checkpoint dict of the layout it changes, a no-op on today's; `migrate` runs them in
order on an unstamped checkpoint and none on one stamped with today's version."""

from __future__ import annotations

import copy

import pytest
import torch

from interleave_data.curriculum import Curriculum
from interleave_data.curriculum_types import CurriculumSettings
from interleave_model.model import migrations
from interleave_model.model.checkpoint import resumed_temperature, save_run_state
from interleave_model.model.migrations import (
    CHECKPOINT_VERSION,
    MIGRATIONS,
    VERSION,
    curriculum_one_owner,
    dropped,
    migrate,
    settings_grouped,
    temperature_on_the_module,
    terms_out_of_loss,
)

# the two entries of git 35e5889 and earlier: the stream's part in the DataModule's, the decisions' in the callback's
CALLBACK = {"stage_index": 1, "steps": 0, "recent": [], "above": 0, "collapsed": 0, "val_score": None,
            "temperature": 1.25, "responses": {4: 1}, "done": False, "stopped": None, "history": []}  # fmt: skip


def _two_entries() -> dict:
    return {
        "InterleaveDataModule": {"stage_index": 0, "moves": [[5, 1]]},
        "callbacks": {"CurriculumCallback": copy.deepcopy(CALLBACK), "Other": {"x": 1}},
        "hyper_parameters": {"seed": 1, "temperature": 1.0, "learning_rate": 0.001, "beta": 0.1},
    }


def test_the_curriculum_in_two_entries_becomes_the_datamodules_one():
    checkpoint = _two_entries()
    curriculum_one_owner(checkpoint)
    state = checkpoint["InterleaveDataModule"]["curriculum"]
    assert checkpoint["InterleaveDataModule"] == {"curriculum": state, "curve_passes": 0}  # the whole curve owed
    assert checkpoint["callbacks"] == {"Other": {"x": 1}}  # the other callbacks' entries stay
    assert (state["stage_index"], state["drawn_index"], state["moves"]) == (1, 0, [[5, 1]])
    assert state["responses"] == {4: 1} and state["temperature"] == 1.25  # the next migration moves it

    today = copy.deepcopy(checkpoint)
    curriculum_one_owner(today)
    assert today == checkpoint


def test_the_migrated_entries_load_into_the_curriculum():
    """What `Curriculum.load_legacy_state` did with the two entries, the migration does on the dict."""
    checkpoint = _two_entries()
    migrate(checkpoint)
    curriculum = Curriculum((4, 8, 16), settings=CurriculumSettings(window=1))
    curriculum.load_state_dict(checkpoint["InterleaveDataModule"]["curriculum"])
    assert (curriculum.state.stage_index, curriculum.state.drawn_index, curriculum.state.moves) == (1, 0, [[5, 1]])
    assert curriculum.state.responses == {4: 1} and checkpoint["temperature"] == 1.25  # the module's now


def test_flat_settings_go_into_their_groups():
    checkpoint = {"hyper_parameters": {"seed": 1, "temperature": 0.7, "eval_num_samples": 2, "sampling": {"top_k": 3}}}
    settings_grouped(checkpoint)
    assert checkpoint["hyper_parameters"] == {
        "seed": 1, "sampling": {"top_k": 3, "temperature": 0.7}, "evaluation": {"num_samples": 2},
    }  # fmt: skip
    grouped = copy.deepcopy(checkpoint)
    settings_grouped(grouped)
    assert grouped == checkpoint


def test_the_terms_settings_leave_loss_for_their_groups():
    checkpoint = {"hyper_parameters": {"loss": {"epsilon": 0.3, "beta": 0.1, "guidance": 0.0}}}
    terms_out_of_loss(checkpoint)
    hparams = checkpoint["hyper_parameters"]
    assert hparams == {"loss": {"epsilon": 0.3}, "kl": {"beta": 0.1}, "guidance": None, "reference_in_group": None}
    terms_out_of_loss(checkpoint)
    assert checkpoint["hyper_parameters"] == hparams


@pytest.mark.parametrize(
    ("curriculum", "module", "stored"),
    [(1.5, None, 1.5), (None, None, None), (1.5, 1.25, 1.25)],
    ids=["raised", "never-raised", "the-modules-wins"],
)
def test_the_temperature_moves_from_the_curriculum_to_the_module(curriculum, module, stored):
    checkpoint = {"InterleaveDataModule": {"curriculum": {"stage_index": 0, "temperature": curriculum}}}
    if module is not None:
        checkpoint["temperature"] = module
    temperature_on_the_module(checkpoint)
    assert checkpoint["InterleaveDataModule"]["curriculum"] == {"stage_index": 0}
    assert checkpoint.get("temperature") == stored


def test_a_dropped_setting_says_so_once_and_an_off_group_goes_silently(caplog, monkeypatch):
    monkeypatch.setattr(migrations, "TOLD", set())  # a fresh process
    drop_credit, drop_group = dropped("loss", "credit", "why not"), dropped("gone", None, "gone why")
    assert drop_credit.__name__ == "drop_loss_credit"
    with caplog.at_level("INFO"):
        for _ in range(2):
            checkpoint = {"hyper_parameters": {"loss": {"credit": "word", "epsilon": 0.2}, "gone": None}}
            drop_credit(checkpoint)
            drop_group(checkpoint)
            assert checkpoint["hyper_parameters"] == {"loss": {"epsilon": 0.2}}
    assert caplog.text.count("checkpoint: model.loss.credit is no longer a setting, ignored (why not)") == 1
    assert "model.gone" not in caplog.text


def test_migrate_runs_every_version_on_an_unstamped_checkpoint_and_stamps_it(caplog, monkeypatch):
    monkeypatch.setattr(migrations, "TOLD", set())
    checkpoint = _two_entries()
    checkpoint["hyper_parameters"]["sft_steps"] = 2  # flat, and removed since
    with caplog.at_level("INFO"):
        applied = migrate(checkpoint)
    assert applied == {version: [f.__name__ for f in functions] for version, functions in MIGRATIONS.items()}
    assert checkpoint[CHECKPOINT_VERSION] == VERSION
    assert checkpoint["hyper_parameters"] == {
        "seed": 1, "sampling": {"temperature": 1.0}, "loss": {}, "kl": {"beta": 0.1}, "guidance": None,
        "optimization": {"learning_rate": 0.001},
    }  # fmt: skip
    assert "model.optimization.sft_steps is no longer a setting, ignored" in caplog.text
    assert resumed_temperature(checkpoint, 1.0) == 1.25 and resumed_temperature(checkpoint, 0.7) == 0.7

    again = copy.deepcopy(checkpoint)
    assert migrate(again) == {} and again == checkpoint


def test_a_checkpoint_stamped_with_todays_version_is_left_as_it_is():
    checkpoint = _two_entries() | {CHECKPOINT_VERSION: VERSION}
    before = copy.deepcopy(checkpoint)
    assert migrate(checkpoint) == {} and checkpoint == before


def test_every_save_is_stamped():
    checkpoint = {"state_dict": {}}
    save_run_state(checkpoint, torch.nn.Linear(1, 1), "tiny", torch.Generator(), torch.device("cpu"), 0)
    assert checkpoint[CHECKPOINT_VERSION] == VERSION

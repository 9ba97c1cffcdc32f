"""The quiet console: known harmless warnings and info lines filtered, all of them back under LOGLEVEL."""

from __future__ import annotations

import logging
import os
import warnings

import datasets
import pytest
import transformers

from interleave_model.run.console import configure_console, evaluation_line, grpo_lines, score_table

NOISE = "Checkpoint directory /runs/demo/version_0/checkpoints exists and is not empty."  # said at every resume


@pytest.fixture
def console(monkeypatch):
    """configure_console, with the process-wide logging state it changes put back afterwards."""
    names = ("", "lightning.pytorch", "lightning.fabric", "vllm")
    levels = {name: logging.getLogger(name).level for name in names}
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))  # put back at teardown
    verbosity = (transformers.utils.logging.get_verbosity(), datasets.utils.logging.get_verbosity())
    yield configure_console
    monkeypatch.delenv("LOGLEVEL", raising=False)
    configure_console()
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    transformers.utils.logging.set_verbosity(verbosity[0])
    datasets.utils.logging.set_verbosity(verbosity[1])


def _shown(message: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(message, UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def _kept(message: str) -> bool:
    name = "lightning.pytorch.utilities.rank_zero"
    return logging.getLogger(name).filter(logging.LogRecord(name, logging.INFO, __file__, 1, message, None, None))


def test_quiet_by_default_and_loglevel_brings_everything_back(console, monkeypatch):
    monkeypatch.delenv("LOGLEVEL", raising=False)
    console()
    assert _shown(NOISE) == [] and _shown("a warning of the run") == ["a warning of the run"]
    engine = "It is recommended to use `self.log('val/alignment_4w', ..., sync_dist=True)` when logging on epoch level"
    assert _shown(engine) == []  # said beside vLLM's process group of one, of values logged with sync_dist=True
    assert not _kept("GPU available: False, used: False") and _kept("`Trainer.fit` stopped: `max_steps=4` reached.")

    monkeypatch.setenv("LOGLEVEL", "INFO")
    console()
    assert _shown(NOISE) == [NOISE] and _kept("GPU available: False, used: False")
    assert logging.getLogger("interleave_data.cache").isEnabledFor(logging.INFO)  # the dataset progress bars
    # vLLM's messages before an engine starts, and the level each engine configures its logger with
    assert logging.getLogger("vllm").isEnabledFor(logging.INFO) and os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    monkeypatch.setenv("LOGLEVEL", "warn")
    console()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"  # vLLM knows the level by this name only
    with pytest.raises(ValueError, match="LOGLEVEL=LOUD is not a logging level"):
        console("loud")


def test_evaluation_line_and_table_give_the_change_since_the_first_evaluation():
    first = {"split": "val", "step": 100, "lengths": [{"n_words": 10, "pairs": 64, "score": 0.5, "exact_match": 0.25}]}
    last = {"split": "val", "step": 300, "lengths": [{"n_words": 10, "pairs": 64, "score": 0.75, "exact_match": 0.5}]}

    assert evaluation_line(first, None, "10 words") == "step 100  val 10w 0.500 exact 0.250  stage 10 words"
    assert (
        evaluation_line(last, first, "10 words")
        == "step 300  val 10w 0.750 (+0.250) exact 0.500 (+0.250)  stage 10 words"
    )
    assert score_table(last, first) == [
        "held-out val at step 300 (alignment score, exact match, change since step 100):",
        "    10 words  0.750 (+0.250) exact 0.500 (+0.250)  (64 pairs)",
    ]


def test_what_grpo_added_is_the_change_since_the_last_evaluation_before_it():
    before = {"split": "val", "step": 350, "lengths": [{"n_words": 10, "pairs": 64, "score": 0.5, "exact_match": 0.0}]}
    last = {"split": "val", "step": 900, "lengths": [{"n_words": 10, "pairs": 64, "score": 0.75, "exact_match": 0.5}]}

    assert grpo_lines(last, before, 351, 900) == [
        "GRPO added, steps 351-900 (held-out score at step 350, before GRPO -> now):",
        "    10 words  0.500 -> 0.750 (+0.250)",
    ]

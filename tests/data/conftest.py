"""Fixtures for the data tests: offline environment and a word-level tokenizer built locally."""

import pytest
from transformers import PreTrainedTokenizerFast

from interleave_data import load_corpus
from tests.data.helpers import build_tokenizer


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Tests never download: any hub access must fail fast with the package's own offline error.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the default corpus and the template words."""
    words = {word for text in load_corpus().texts for word in text.words}
    return build_tokenizer(words | {"A:", "B:", "Interleave:"})

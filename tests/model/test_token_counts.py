"""The preflight's token counts are collate's, example by example, whatever state the shared tokenizer was left in."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from interleave_model import token_counts
from interleave_model.policy import prepare_tokenizer
from interleave_model.token_counts import Longest, lengths, longest


@pytest.fixture(params=["tiny", "llama3", "qwen2", "gpt2"])
def tokenizer(request, family_folders, make_module):
    """The tiny word-level tokenizer (no chat template) and each family's BPE (chat templates, BOS or none)."""
    if request.param == "tiny":
        return make_module().tokenizer
    return prepare_tokenizer(AutoTokenizer.from_pretrained(family_folders[request.param]))


def _collated(dm, examples) -> tuple[list[int], list[int]]:
    batch = dm.collate(examples, "eval")
    return batch["prompt_mask"].sum(-1).tolist(), [len(ids) for ids in batch["target_ids"]]


def test_every_example_is_counted_as_collate_tokenizes_it(tokenizer, make_datamodule, monkeypatch):
    monkeypatch.setattr(token_counts, "CHUNK", 7)  # several chunks, the last one short
    dm = make_datamodule(tokenizer)
    examples = [e for split in ("train", "val", "test") for e in dm.examples(8, split)]
    collated, prompts = _collated(dm, examples), dm.collate(examples, "eval")["prompts"]
    # an earlier call may leave truncation (and padding) set on the shared backend; the counts must not see it
    tokenizer(["a b c d e f"], truncation=True, max_length=2, padding="max_length")
    backend = token_counts._backend(tokenizer, token_counts.pipeline(tokenizer))

    counted = list(lengths(tokenizer, backend, prompts, not tokenizer.chat_template))
    targets = list(lengths(tokenizer, backend, [e.target for e in examples], False))

    assert (counted, targets) == collated
    assert longest(dm, examples) == Longest(max(counted), max(targets))


def test_a_tokenizer_without_a_rust_backend_is_counted_through_its_own_call(family_folders, make_datamodule,
                                                                              monkeypatch):  # fmt: skip
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(family_folders["llama3"]))
    monkeypatch.setattr(token_counts, "pipeline", lambda tokenizer: None)  # as for a slow (pure Python) tokenizer
    dm = make_datamodule(tokenizer)
    examples = dm.examples(8, "train")
    prompts, targets = _collated(dm, examples)
    assert longest(dm, examples) == Longest(max(prompts), max(targets))


def test_special_token_text_is_split_when_the_tokenizer_says_so(family_folders, make_datamodule):
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(family_folders["llama3"]))
    tokenizer.split_special_tokens = True  # the chat template's <|begin_of_text|> and headers become plain text
    dm = make_datamodule(tokenizer)
    examples = dm.examples(4, "train")
    prompts, targets = _collated(dm, examples)
    assert longest(dm, examples) == Longest(max(prompts), max(targets))

"""Policy loading: the tiny model and tokenizer, the real from_pretrained path, tokenizer checks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from interleave_model.policy import (
    PolicyError,
    TinyModelConfig,
    build_tiny_model,
    build_tiny_tokenizer,
    load_pretrained,
    prepare_tokenizer,
)

TEXTS = [["the", "cat", "sat"], ["on", "the", "mat", "é"]]


def test_tiny_tokenizer_is_deterministic_and_round_trips_words():
    tok = build_tiny_tokenizer(TEXTS, extra_words=["A:"])
    again = build_tiny_tokenizer(list(reversed(TEXTS)), extra_words=["A:"])
    assert tok.get_vocab() == again.get_vocab()
    ids = tok("A: the  mat é", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == "A: the mat é"
    assert tok.padding_side == "left" and tok.pad_token_id != tok.eos_token_id


def test_tiny_model_is_seeded_and_embeddings_frozen():
    tok = build_tiny_tokenizer(TEXTS)
    config = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    a, b = build_tiny_model(tok, config, seed=3), build_tiny_model(tok, config, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not a.get_input_embeddings().weight.requires_grad
    assert a.lm_head.weight is a.get_input_embeddings().weight  # tied: frozen output rows too


def test_saved_tiny_model_reloads_through_from_pretrained(tmp_path):
    tok = build_tiny_tokenizer(TEXTS)
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_pretrained(str(tmp_path))
    ids = tok(["the cat sat"], return_tensors="pt").input_ids
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded_tok.padding_side == "left"


def test_missing_model_path_is_one_clear_line(tmp_path):
    with pytest.raises(PolicyError, match="model path does not exist: .*nowhere") as err:
        load_pretrained(str(tmp_path / "nowhere"))
    assert "\n" not in str(err.value)


def test_tokenizer_pad_falls_back_to_eos_and_refuses_neither(tmp_path):
    tok = build_tiny_tokenizer(TEXTS)
    tok.save_pretrained(tmp_path)
    no_pad = AutoTokenizer.from_pretrained(tmp_path)
    no_pad.pad_token = None
    assert prepare_tokenizer(no_pad).pad_token_id == no_pad.eos_token_id
    no_pad.pad_token, no_pad.eos_token = None, None
    with pytest.raises(PolicyError, match="no EOS token"):
        prepare_tokenizer(no_pad, "my-model")

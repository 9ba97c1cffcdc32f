"""Policy loading: the tiny model and tokenizer, the real from_pretrained path, tokenizer checks."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer

from interleave_model.model.policy import (
    PolicyError,
    TinyModelConfig,
    build_tiny_model,
    build_tiny_tokenizer,
    load_pretrained,
    prepare_tokenizer,
    stop_token_ids,
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
    with pytest.raises(PolicyError, match="^my-model: the tokenizer has neither a pad nor an EOS token") as err:
        prepare_tokenizer(no_pad, "my-model")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("name", "stops"),
    [
        ("llama3", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),  # generation_config lists three
        ("qwen2", ["<|endoftext|>", "<|im_end|>"]),
        ("gpt2", ["<|endoftext|>"]),  # an int in generation_config, the same id as the tokenizer's EOS
    ],
)
def test_stop_ids_are_the_generation_config_eos_ids_and_the_tokenizer_eos(family_folders, name, stops):
    model, tok = load_pretrained(str(family_folders[name]))
    assert stop_token_ids(model, tok) == sorted(tok.convert_tokens_to_ids(stops))
    model.generation_config.eos_token_id = None  # a folder without generation_config.json: the tokenizer's EOS
    assert stop_token_ids(model, tok) == [tok.eos_token_id]


def test_tiny_model_stops_at_its_one_eos():
    tok = build_tiny_tokenizer(TEXTS)
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32))
    assert stop_token_ids(model, tok) == [tok.eos_token_id]


def test_model_folder_without_tokenizer_is_one_clear_line(family_folders, tmp_path):
    folder = tmp_path / "llama3"
    shutil.copytree(family_folders["llama3"], folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(PolicyError, match="no tokenizer in the model folder") as err:
        load_pretrained(str(folder))
    assert str(folder) in str(err.value) and "\n" not in str(err.value)


def test_lora_on_the_top_layers_adapts_only_them_and_the_backward_stops_below(family_folders):
    from transformers import AutoModelForCausalLM

    from interleave_model.model.policy import LoraSettings, PolicyError, apply_lora

    base = AutoModelForCausalLM.from_pretrained(family_folders["llama3"])
    total = base.config.num_hidden_layers
    model = apply_lora(base, LoraSettings(r=2, top_layers=1))
    adapted = {int(n.split(".layers.")[1].split(".")[0]) for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {total - 1}
    reached = []  # the layers whose input the backward reaches
    for layer in model.get_base_model().model.layers:
        layer.register_full_backward_hook(lambda module, g_in, g_out: reached.append(module))
    model(input_ids=torch.randint(0, 100, (2, 5))).logits.sum().backward()
    assert reached == [model.get_base_model().model.layers[-1]]
    with pytest.raises(PolicyError, match="top_layers: 99 is not between 1 and the model's 2 layers"):
        apply_lora(AutoModelForCausalLM.from_pretrained(family_folders["llama3"]), LoraSettings(top_layers=99))

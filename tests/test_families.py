"""The family fixtures themselves follow the conventions they stand for (tests/families.py)."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def test_llama3_folder_has_the_conventions_that_break_naive_code(family_folders):
    folder = family_folders["llama3"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generation = GenerationConfig.from_pretrained(folder)
    assert tokenizer.convert_ids_to_tokens(0) == "!"  # masking with * 0 decodes as "!"
    assert tokenizer.pad_token is None
    assert tokenizer.eos_token == "<|eot_id|>"
    assert isinstance(generation.eos_token_id, list) and len(generation.eos_token_id) == 3
    assert tokenizer.eos_token_id in generation.eos_token_id
    assert tokenizer("a b").input_ids[0] == tokenizer.bos_token_id  # BOS from the post-processor
    assert "bos_token" in tokenizer.chat_template
    assert min(tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"])) > 1000  # after the vocabulary
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.tie_word_embeddings
    assert model.config.hidden_size // model.config.num_attention_heads == 64


def test_qwen2_and_gpt2_folders(family_folders):
    qwen = AutoTokenizer.from_pretrained(family_folders["qwen2"])
    assert (qwen.bos_token, qwen.pad_token, qwen.eos_token) == (None, "<|endoftext|>", "<|im_end|>")
    assert "<|im_start|>" in qwen.chat_template
    gpt2 = AutoTokenizer.from_pretrained(family_folders["gpt2"])
    assert gpt2.chat_template is None and gpt2.pad_token is None
    assert gpt2.bos_token_id == gpt2.eos_token_id
    assert GenerationConfig.from_pretrained(family_folders["gpt2"]).eos_token_id == gpt2.eos_token_id


def test_byte_level_round_trip(family):
    name, folder = family
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "Fragment A: the quick (brown) fox's tail, 42 -- ünïcode"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text

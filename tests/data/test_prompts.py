import pytest
from transformers import AutoTokenizer

from interleave_data.prompts import TEMPLATES, format_prompt
from tests.data.helpers import build_tokenizer

CHAT = (
    "{% for m in messages %}[BOS] <user> {{ m.content }} </user>{% endfor %}"
    "{% if add_generation_prompt %} <bot>{% endif %}"
)


def test_default_template_frames_two_processes_in_one_turn():
    prompt = format_prompt("one two", "three four")

    assert "Do this all in one turn" in prompt
    assert "two parallel processes" in prompt
    assert prompt.index("one two") < prompt.index("three four")


def test_compact_template_is_exact():
    assert format_prompt("x y", "{b} z", "compact") == "A: x y\nB: {b} z\nInterleave:"


def test_unknown_template_lists_the_names():
    with pytest.raises(ValueError, match="unknown prompt template 'nope'") as info:
        format_prompt("a", "b", "nope")
    assert all(name in str(info.value) for name in TEMPLATES)


def test_chat_template_wraps_the_instruction_as_one_user_turn():
    plain = format_prompt("a", "b", "compact")

    assert format_prompt("a", "b", "compact", build_tokenizer({"a"}, CHAT)) == f"[BOS] <user> {plain} </user> <bot>"
    assert format_prompt("a", "b", "compact", build_tokenizer({"a"})) == plain


def test_prompt_ids_are_the_models_own_chat_template_ids_with_one_bos(family, make_datamodule):
    name, folder = family
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # what the policy does for a tokenizer with no pad
    dm = make_datamodule(tokenizer, template="two_processes")
    examples = [dm.examples(4, "val")[0], dm.examples(8, "val")[0]]

    batch = dm.collate(examples, "eval")

    for row, example in enumerate(examples):
        text = TEMPLATES["two_processes"].format(a=example.a, b=example.b)
        if name == "gpt2":  # no chat template: the plain instruction, with whatever the tokenizer adds (nothing)
            expected = tokenizer(text).input_ids
        else:
            message = [{"role": "user", "content": text}]
            expected = tokenizer.apply_chat_template(message, tokenize=True, add_generation_prompt=True)["input_ids"]
        ids = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        assert ids == expected
        bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>") if name == "llama3" else tokenizer.bos_token_id
        assert ids.count(bos) == (1 if name == "llama3" else 0)  # Llama-3: the template's BOS, not a second one

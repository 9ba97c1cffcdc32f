import pytest

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

"""Named prompt templates. The expected answer to every template is exactly the example's ``target``."""

from typing import Literal, get_args

# The template names, as a type: a config naming another is refused when it is parsed.
TemplateName = Literal["two_processes", "compact"]

TEMPLATES: dict[str, str] = {
    # The framing that worked for instruct models. Without "Do this all in one turn" they waited for more input.
    "two_processes": (
        "Run two parallel processes. Process A reads fragment A and process B reads fragment B; each keeps its own "
        "place in its own fragment. Take turns: process A emits the next word of fragment A, then process B emits "
        "the next word of fragment B, and so on until both fragments are used up. Copy every word exactly as "
        "written, punctuation included. Answer with only the interleaved words, separated by single spaces, and "
        "nothing else. Do this all in one turn.\n\n"
        "Fragment A: {a}\n\n"
        "Fragment B: {b}"
    ),
    # Short enough for tiny and base models, and cheap for the CPU demo.
    "compact": "A: {a}\nB: {b}\nInterleave:",
}


assert set(get_args(TemplateName)) == set(TEMPLATES), "TemplateName must name every template"


def format_prompt(a: str, b: str, template: TemplateName = "two_processes", tokenizer=None) -> str:
    """Fills a template with fragments ``a`` and ``b``.

    Args:
        a: Fragment A, words joined by spaces.
        b: Fragment B, words joined by spaces.
        template: A key of ``TEMPLATES``.
        tokenizer: If given and it has a chat template, the instruction becomes one user message followed by the
            generation prompt; otherwise the plain text is returned.

    Raises:
        ValueError: Unknown template name.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose one of: {', '.join(TEMPLATES)}")
    text = TEMPLATES[template].format(a=a, b=b)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def adds_special_tokens(tokenizer) -> bool:
    """Whether a prompt from `format_prompt` is tokenized with the tokenizer's special tokens: not when a chat template
    wrote them (BOS), which would double them."""
    return not getattr(tokenizer, "chat_template", None)

"""Sample dumps as TensorBoard markdown: every text whole inside a code block, the first departure marked."""

from __future__ import annotations

import pytest

from interleave_model.run.samples import departure, mark_first_departure, sample_markdown

PROMPT = "A: one *two*\n# B: three four\n\nInterleave:"  # markdown would read `*`, `#` and the blank line


def _code_block(markdown: str, after: str) -> list[str]:
    """The lines of the indented code block that follows the paragraph starting with `after`."""
    paragraphs = markdown.split("\n\n")
    i = next(k for k, p in enumerate(paragraphs) if p.startswith(after))
    block = []
    for paragraph in paragraphs[i + 1 :]:
        if not paragraph.startswith("    "):
            break
        block += paragraph.split("\n")
    return block


def test_prompt_target_and_completion_are_each_one_whole_code_block():
    markdown = sample_markdown("step 4 best", PROMPT, "one three two four", "one three two four")

    assert _code_block(markdown, "prompt:") == [f"    {line}" for line in PROMPT.split("\n")]
    assert _code_block(markdown, "target:") == ["    one three two four"]
    assert _code_block(markdown, "completion (matches the target)") == ["    one three two four"]


AT = "departs from the target at word"


@pytest.mark.parametrize(
    ("completion", "marked", "where"),
    [
        ("one three  two # five", "one three  two ⟦#⟧ five", f"{AT} 4 of 4: `#` where the target has `four`"),
        ("one three", "one three⟦⟧", "stops after word 2 of the target's 4"),
        ("one three two four more", "one three two four ⟦more⟧", "goes on after the target's 4 words with `more`"),
        ("zero", "⟦zero⟧", f"{AT} 1 of 4: `zero` where the target has `one`"),
    ],
)  # fmt: skip
def test_the_first_departing_word_is_marked_and_named(completion, marked, where):
    first_error, said = departure(completion, "one three two four")

    assert said == where
    assert mark_first_departure(completion, first_error) == marked  # the rest, spaces included, as it was
    markdown = sample_markdown("head", "p", "one three two four", completion)
    assert _code_block(markdown, f"completion ({where}, marked ⟦ ⟧)") == [f"    {marked}"]

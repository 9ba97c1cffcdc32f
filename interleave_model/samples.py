"""A sampled completion as TensorBoard markdown: prompt, target and completion each whole, the first departure marked.

TensorBoard's text tab renders markdown, where a prompt's own newlines, `#` or `*` would turn into prose and
headings. Each text is an indented code block (every line indented, so nothing in it is markdown), and the
completion's first word that departs from the target is set in ⟦ ⟧ (the alignment's `first_error`: the length of
the common word prefix).
"""

from __future__ import annotations

import re

from interleave_model.alignment import align

MARK_OPEN, MARK_CLOSE = "⟦", "⟧"


def mark_first_departure(completion: str, first_error: int) -> str:
    """The completion with its word at index `first_error` in ⟦ ⟧, or ⟦⟧ at its end when it stops before it.

    Everything else, whitespace included, is kept as it was.
    """
    spans = [m.span() for m in re.finditer(r"\S+", completion)]
    if first_error < len(spans):
        start, end = spans[first_error]
        return f"{completion[:start]}{MARK_OPEN}{completion[start:end]}{MARK_CLOSE}{completion[end:]}"
    return f"{completion}{MARK_OPEN}{MARK_CLOSE}"


def departure(completion: str, target: str) -> tuple[int | None, str]:
    """Where the completion first departs from the target: (word index or None when equal, a sentence saying so)."""
    first_error = align(completion, target).first_error
    said, wanted = completion.split(), target.split()
    if said == wanted:
        return None, "matches the target"
    if first_error >= len(said):
        return first_error, f"stops after word {first_error} of the target's {len(wanted)}"
    if first_error >= len(wanted):
        return first_error, f"goes on after the target's {len(wanted)} words with `{said[first_error]}`"
    return first_error, (
        f"departs from the target at word {first_error + 1} of {len(wanted)}: `{said[first_error]}` where the "
        f"target has `{wanted[first_error]}`"
    )


def sample_markdown(head: str, prompt: str, target: str, completion: str) -> str:
    """One sample for TensorBoard's text tab: a bold head, then prompt, target and marked completion as code."""
    first_error, where = departure(completion, target)
    shown = completion if first_error is None else mark_first_departure(completion, first_error)
    mark = "" if first_error is None else f", marked {MARK_OPEN} {MARK_CLOSE}"
    parts = [f"**{head}**", "prompt:", _code(prompt), "target:", _code(target), f"completion ({where}{mark}):"]
    parts.append(_code(shown))
    return "\n\n".join(parts)


def _code(text: str) -> str:
    """An indented code block: markdown leaves every character of it as it is."""
    return "\n".join(f"    {line}" for line in (text.splitlines() or [""]))

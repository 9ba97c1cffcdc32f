"""lm-evaluation-harness tasks: `interleave_<N>w` for each curriculum length and the group `interleave`.

    lm_eval --model hf --model_args pretrained=PATH --tasks interleave --apply_chat_template \
        --include_path "$(python -m interleave_model.evaluation.lm_eval_tasks)"

The documents are the held-out test pairs `cli.py test` scores (`documents.load`), the prompt is the project's template,
the answer greedy within the held-out budget of its length (`answer_budget`), and each answer is scored by the
project's alignment (`documents.process_results`). This folder holds YAML and the functions they name; nothing in
training imports lm-eval.
"""

from pathlib import Path

FOLDER = Path(__file__).parent
"""The folder to pass to lm-eval as `--include_path`."""

LENGTHS = (10, 25, 50, 100, 200, 500)
"""One task per length: the curriculum's stages."""

METRICS = ("alignment", "exact_match", "a_accuracy", "b_accuracy", "first_error")
"""Per-pair measures, each averaged over the pairs: the alignment score, exact match, the share of each fragment's words
placed right, and where the answer first goes wrong (relative to the target's length)."""

TEXT_METRICS = ("alignment_stderr_texts", "texts")
"""The alignment score's standard error over texts (`cli.py test`'s ``score_stderr``), and the texts it rests on.

Pairs cut from a common text are correlated, so the tasks average their measures by a function of their own, for which
lm-eval reports no standard error ("N/A"): its own would treat the pairs as independent."""

# What `--metadata` may set, with `cli.py test`'s defaults (`data.*` keys of the same names), except the pairs per
# length: 128, as in the project's held-out results (docs/RESULTS.md), where `cli.py test` defaults to the first 32 of
# them. More pairs narrow the part of a standard error that lies within texts, not the part between them (the default
# corpus's test split has 8 texts).
DEFAULTS = {"corpus": None, "seed": 0, "test_pairs": 128, "split_fractions": (0.8, 0.1, 0.1),
            "template": "two_processes"}  # fmt: skip

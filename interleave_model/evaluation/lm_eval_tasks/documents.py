"""The functions the task YAMLs name (`!function documents.<name>`): documents, prompt, per-pair scores and their
aggregation.

lm-eval imports this file by its path, so it imports the project by its package names and keeps no state.
"""

from __future__ import annotations

import math

import datasets

from interleave_data.corpus import load_corpus
from interleave_data.pairs import build_examples, check_fractions, split_texts
from interleave_data.prompts import TEMPLATES, format_prompt
from interleave_model.evaluation.alignment import align
from interleave_model.evaluation.lm_eval_tasks import DEFAULTS
from interleave_model.evaluation.metric import count_texts, stderr_over_texts


def load(n_words: int, **metadata) -> datasets.DatasetDict:
    """The held-out test pairs of one length, as `cli.py test` builds them, in a `test` split.

    `metadata` is lm-eval's `--metadata` (merged with `--model_args`, whose keys are ignored here): `corpus` (a path
    or a list of sources, as `data.corpus`), `seed`, `test_pairs`, `split_fractions` and `template` (as `data.*`).
    The first `test_pairs` of a longer build are the same pairs, so 32 here equals `cli.py test`'s default.
    """
    settings = DEFAULTS | {key: metadata[key] for key in DEFAULTS if metadata.get(key) is not None}
    if settings["template"] not in TEMPLATES:
        raise ValueError(
            f"--metadata template: unknown {settings['template']!r}; choose one of: {', '.join(TEMPLATES)}"
        )
    corpus = settings["corpus"]
    texts = load_corpus([corpus] if isinstance(corpus, str) else corpus).texts
    test = split_texts(texts, check_fractions(settings["split_fractions"]), int(settings["seed"]))["test"]
    examples = build_examples(test, n_words, int(settings["test_pairs"]), int(settings["seed"]), "test")
    rows = [example.to_dict() | {"prompt": format_prompt(example.a, example.b, settings["template"])}
            for example in examples]  # fmt: skip
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc: dict) -> str:
    """The project's prompt, as plain text: lm-eval's `--apply_chat_template` makes it the one user message."""
    return doc["prompt"]


def process_results(doc: dict, results: list[str]) -> dict[str, float | tuple]:
    """One pair's measures from its greedy answer, by the project's alignment (`evaluation.alignment.align`), and
    what the standard error over texts needs of it: its texts and its score."""
    diagnostics = align(results[0], doc["target"])
    return {
        "alignment": diagnostics.score,
        "exact_match": float(diagnostics.distance == 0),
        "a_accuracy": diagnostics.a_accuracy,
        "b_accuracy": diagnostics.b_accuracy,
        "first_error": diagnostics.relative_first_error,
        "alignment_stderr_texts": (doc["text_a"], doc["text_b"], diagnostics.score),
        "texts": (doc["text_a"], doc["text_b"]),
    }


def pair_mean(values: list[float]) -> float:
    """The mean over pairs: lm-eval's `mean` under another name, so that lm-eval adds no standard error over
    independent pairs (it writes "N/A"); the score's over texts is `alignment_stderr_texts`."""
    return math.fsum(values) / len(values)


def alignment_stderr_texts(items: list[tuple[str, str, float]]) -> float:
    """The alignment score's standard error over texts, from each pair's ``(text_a, text_b, score)``: the function
    behind `cli.py test`'s ``score_stderr`` (`evaluation.metric.stderr_over_texts`)."""
    return stderr_over_texts([score for _, _, score in items], [(a, b) for a, b, _ in items])


def distinct_texts(items: list[tuple[str, str]]) -> int:
    """The texts the pairs were cut from, from each pair's ``(text_a, text_b)``: `cli.py test`'s ``texts``."""
    return count_texts(items)

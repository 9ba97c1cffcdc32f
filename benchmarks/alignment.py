"""Speed of the alignment score: median milliseconds per pair at 10-500 words per fragment. Prints one JSON line.

Targets are two fragments of real text (Python's own documentation, the default corpus, so a 500-word pair has
far more than edlib's 256 distinct words) interleaved; predictions are the target with about 10% of its words
substituted, deleted or followed by an extra word. Each size reports `score` and `align` (all diagnostics), the
plain O(n*m) Python DP timed in the same run (a few pairs only) and the speed-ups against it, the share of pairs past
edlib's symbol limit, and the engines behind the choices: edlib vs rapidfuzz for the distance, edlib vs the Python
bit-parallel traceback for the path (``null`` where no pair fits edlib).

    python benchmarks/alignment.py [--pairs 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence

import edlib
from provenance import provenance
from rapidfuzz.distance import Levenshtein

from interleave_data.corpus import default_topics
from interleave_model.evaluation.alignment import (
    EDLIB_MAX_SYMBOLS,
    _bitparallel_runs,
    _edlib_runs,
    _encode,
    align,
    reference_distance,
    score,
)

VOCABULARY = " ".join(default_topics().values()).split()
WORDS_PER_FRAGMENT = (10, 100, 200, 500)
DP_PAIRS = {10: 20, 100: 5, 200: 3, 500: 3}
EDIT_RATE = 0.1


def make_pair(rng: random.Random, n_words: int) -> tuple[str, str]:
    """A (prediction, target) pair: target ``a1 b1 a2 b2 ...`` from two places in the text, edited prediction."""
    fragments = []
    for _ in range(2):
        start = rng.randrange(len(VOCABULARY) - n_words)
        fragments.append(VOCABULARY[start : start + n_words])
    target = [w for pair in zip(*fragments, strict=True) for w in pair]
    prediction = []
    for w in target:
        r = rng.random()
        if r < EDIT_RATE / 3:
            prediction.append(rng.choice(VOCABULARY))
        elif r < 2 * EDIT_RATE / 3:
            continue
        elif r < EDIT_RATE:
            prediction += [w, rng.choice(VOCABULARY)]
        else:
            prediction.append(w)
    return " ".join(prediction), " ".join(target)


def median_ms(fn: Callable, items: Sequence[tuple], repeats: int) -> float | None:
    """Median wall time of ``fn(*item)`` in milliseconds over every item and repeat; None without items."""
    times = []
    for _ in range(repeats):
        for item in items:
            start = time.perf_counter()
            fn(*item)
            times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 4) if times else None


def measure(rng: random.Random, n_words: int, n_pairs: int) -> dict:
    pairs = [make_pair(rng, n_words) for _ in range(n_pairs)]
    encoded = [_encode(p.split(), t.split()) for p, t in pairs]
    fits_edlib = [(p, t) for p, t, n_symbols in encoded if n_symbols <= EDLIB_MAX_SYMBOLS]
    dp_pairs = pairs[: DP_PAIRS[n_words]]
    if any(score(p, t) != 1 - reference_distance(p, t) / max(len(p.split()), len(t.split())) for p, t in dp_pairs):
        raise AssertionError("score disagrees with the reference DP")

    score_ms = median_ms(score, pairs, repeats=5)
    align_ms = median_ms(align, pairs, repeats=3)
    dp_ms = median_ms(reference_distance, dp_pairs, repeats=1)
    return {
        "score_ms": score_ms,
        "align_ms": align_ms,
        "dp_ms": dp_ms,
        "score_speedup": round(dp_ms / score_ms),
        "align_speedup": round(dp_ms / align_ms),
        "past_edlib_limit": round(1 - len(fits_edlib) / n_pairs, 2),
        "engines": {
            "encode_ms": median_ms(lambda p, t: _encode(p.split(), t.split()), pairs, repeats=3),
            "distance_rapidfuzz_ms": median_ms(Levenshtein.distance, [(p, t) for p, t, _ in encoded], repeats=3),
            "distance_edlib_ms": median_ms(lambda p, t: edlib.align(bytes(p), bytes(t)), fits_edlib, repeats=3),
            "path_edlib_ms": median_ms(_edlib_runs, fits_edlib, repeats=3),
            "path_python_ms": median_ms(_bitparallel_runs, [(p, t) for p, t, _ in encoded], repeats=2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40, help="pairs per size (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = {str(n): measure(rng, n, args.pairs) for n in WORDS_PER_FRAGMENT}
    at_500 = results["500"]
    print(
        json.dumps(
            {
                "benchmark": "alignment",
                **provenance(),
                "cpus": os.cpu_count(),
                "pairs": args.pairs,
                "edit_rate": EDIT_RATE,
                "words_per_fragment": results,
                "targets_met_at_500": {
                    "score_ms<=1": at_500["score_ms"] <= 1,
                    "align_ms<=5": at_500["align_ms"] <= 5,
                    "score_speedup>=500": at_500["score_speedup"] >= 500,
                },
            }
        )
    )


if __name__ == "__main__":
    main()

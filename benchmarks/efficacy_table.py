"""The arms of `benchmarks/efficacy.py` as a Markdown table: one row per JSON line, held-out scores before -> after.

    python benchmarks/efficacy_table.py benchmarks/results/tiny-climb.jsonl

Each row names the arm (its overlay), its seed, minutes and steps, the length and milestone it ended at, then at each
tested length the score before -> after with the after's standard error, and pass@1 / pass@k before -> after. The
commit and command of each row are in its line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(lines: list[dict]) -> list[str]:
    """The table's lines for these arms (all tested at the same lengths as the first)."""
    lengths = list(lines[0]["test_end"])
    head = ["arm", "seed", "training min", "steps", "length at end", *lengths]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in lines:
        name = arm.get("arm", Path(arm["configs"][-1]).stem)  # lines written before arms had names: the overlay's
        cells = [name, str(arm["seed"]), str(arm["training_minutes"]), str(arm["steps"]),
                 f"{arm['length_end']} (milestone {arm['milestone']}{', done' if arm['done'] else ''})"]  # fmt: skip
        for n in lengths:
            before, after = arm["test_start"].get(n, {}), arm["test_end"].get(n, {})
            passes = [k for k in after if k.startswith("pass@")]
            cell = f"{before.get('score', float('nan')):.3f} -> {after['score']:.3f} ± {after['score_stderr']:.3f}"
            cell += "".join(f", {k} {before.get(k, float('nan')):.2f} -> {after[k]:.2f}" for k in passes)
            cells.append(cell)
        table.append("| " + " | ".join(cells) + " |")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", help="a file of efficacy.py's JSON lines")
    args = parser.parse_args()
    lines = [json.loads(line) for line in Path(args.jsonl).read_text().splitlines() if line.strip()]
    print("\n".join(rows(lines)))


if __name__ == "__main__":
    main()

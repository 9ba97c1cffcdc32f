"""The README's picture, drawn from the committed results: SmolLM2's held-out score against minutes of GRPO and of
supervised steps (`efficacy.py`'s JSON lines), and its capability curve by length (an evaluation report).

    python benchmarks/plot_results.py [--efficacy benchmarks/results/smollm2-efficacy.jsonl]
        [--curve benchmarks/results/smollm2-capability-curve.json] [--out docs/results.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COLORS = {"lift": "tab:red", "sft": "tab:blue"}
LABELS = {"lift": "GRPO", "sft": "supervised steps"}


# settings that change where a run's time goes or how often it is measured, not what it learns
NOT_TRIAL = {"micro_batch_size", "warm_dir", "threads", "clock", "eval_batch_size", "eval_every"}


def trial_settings(run: dict) -> dict:
    """The settings that make a run the trial's or a lever's."""
    return {key: value for key, value in run["settings"].items() if key not in NOT_TRIAL}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--efficacy", default=str(RESULTS / "smollm2-efficacy.jsonl"))
    parser.add_argument("--curve", default=str(RESULTS / "smollm2-capability-curve.json"))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "results.png"))
    args = parser.parse_args()
    runs = [json.loads(line) for line in Path(args.efficacy).read_text().splitlines() if line.strip()]
    report = json.loads(Path(args.curve).read_text())

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    trial = trial_settings(runs[0])
    levers = 0
    for run in runs:
        minutes = [point["s"] / 60 for point in run["curve"]]
        scores = [point["10w"] for point in run["curve"]]
        if trial_settings(run) == trial:
            left.plot(minutes, scores, color=COLORS[run["arm"]], marker=".", alpha=0.8,
                      label=f"{LABELS[run['arm']]}, seed {run['seed']}")  # fmt: skip
        else:  # a lever (docs/RESULTS.md names each)
            label = "GRPO, other settings" if not levers else None
            left.plot(minutes, scores, color="gray", linewidth=0.8, alpha=0.6, label=label)
            levers += 1
    left.axhline(0.9, color="gray", linestyle=":", linewidth=1)
    left.set(xlabel="CPU minutes of training after the warm-start (one thread)", ylabel="held-out score, 10 words",
             title="SmolLM2-135M-Instruct + LoRA: GRPO against supervised steps", ylim=(0, 1))  # fmt: skip
    left.legend(fontsize=8)

    rows = report["lengths"]
    lengths = [row["n_words"] for row in rows]
    for key, label in (("score", "alignment score"), ("exact_match", "exact match")):
        right.plot(lengths, [row[key] for row in rows], marker="o", label=label)
    passes = sorted((k for k in rows[0] if k.startswith("pass@")), key=lambda k: int(k[5:]))
    for key in passes:
        right.plot(lengths, [row[key] for row in rows], marker="s", linestyle="--", label=key)
    right.set(xlabel="words per fragment", ylabel="held-out", title="SmolLM2-135M-Instruct untrained, by length",
              ylim=(0, 1), xticks=lengths)  # fmt: skip
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(json.dumps({"benchmark": "plot_results", "out": args.out, "runs": len(runs), "lengths": lengths}))


if __name__ == "__main__":
    main()

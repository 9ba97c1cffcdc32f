"""Evaluation reports: the per-length table as JSON and Markdown, the score-vs-length figure, and comparison.

```
python -m interleave_model.evaluation.report A.json B.json [...]    # print reports side by side, with B - A
python -m interleave_model.evaluation.report A B --plot curves.png  # and draw their score-vs-length curves
```

A report can also be lm-eval's output for the project's tasks (its `results_*.json`, or the `--output_path` folder
holding one): `from_lm_eval` reads it as a report of the test split, so models measured by lm-eval, served or local,
stand beside the project's own runs.

A report (`build_report`) is a JSON object: ``split``, ``created``, ``model`` (name, checkpoint, step, every
hyperparameter), ``generation`` (greedy budget, pass@k sampling), ``data`` (corpus, template, seed, pairs per length),
``run`` (global seed, world size, library versions) and ``lengths``, one row per length with every measure of
`interleave_model.evaluation.evaluator` (see docs/EVALUATION.md for their meaning).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from interleave_data.atomic import replacing
from interleave_model.evaluation.lm_eval_tasks import DEFAULTS

# Column headers of the Markdown table, in order; measures not listed here follow under their own names.
COLUMNS = {
    "n_words": "words",
    "pairs": "pairs",
    "texts": "texts",
    "score": "score",
    "score_stderr": "± s.e.",
    "exact_match": "exact",
    "first_error": "first error",
    "a_accuracy": "A acc",
    "b_accuracy": "B acc",
    "substitutions": "sub/word",
    "insertions": "ins/word",
    "deletions": "del/word",
    "length_ratio": "length",
    "copy_share": "copies",
    "sample_score": "sample score",
    "distinct": "distinct",
    "self_similarity": "self-sim",
}
SAMPLED = ("sample_score", "distinct", "self_similarity")  # follow pass@k in tables
COUNTS = ("n_words", "pairs", "texts")  # what a row counts, not measures: no difference is taken


def build_report(
    results: Mapping[str, Any],
    model: Mapping[str, Any],
    generation: Mapping[str, Any],
    data: Mapping[str, Any],
    run: Mapping[str, Any],
) -> dict[str, Any]:
    """Assemble a report from an evaluation's table (`InterleaveGRPO.eval_results`) and what produced it."""
    return {
        "split": results["split"],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": jsonable(model),
        "generation": jsonable(generation),
        "data": jsonable(data),
        "run": jsonable(run),
        "lengths": jsonable(results["lengths"]),
    }


def jsonable(value: Any) -> Any:
    """Dataclasses, tuples and paths as plain JSON values; anything else unknown as its `str`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def write_report(report: Mapping[str, Any], dirpath: str | os.PathLike) -> Path:
    """Write ``report.json`` and ``report.md`` into `dirpath` (created), each atomically; returns the JSON path."""
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    # allow_nan: a measure without data is NaN, which Python's json reads back
    with replacing(dirpath / "report.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    with replacing(dirpath / "report.md") as tmp:
        tmp.write_text(to_markdown(report), encoding="utf-8")
    return dirpath / "report.json"


def save_figure(figure, path: str | os.PathLike) -> None:
    """Save a matplotlib figure as PNG atomically."""
    with replacing(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """Read a report; a folder means its ``report.json`` (or ``eval/report.json``, for a run folder), or the newest
    lm-eval ``results_*.json`` below it. lm-eval's results become a report through `from_lm_eval`."""
    path = Path(path)
    if path.is_dir():
        found = [p for p in (path / "report.json", path / "eval" / "report.json") if p.exists()]
        found = found or sorted(path.rglob("results_*.json"), key=lambda p: p.name)[-1:]
        path = found[0] if found else path / "report.json"
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    return from_lm_eval(report) if "lm_eval_version" in report else report


# lm-eval's name of each project measure in a task's results ("<metric>,<filter>"): the score's standard error is the
# tasks' own over texts (lm-eval's "alignment_stderr" would be over independent pairs, and the tasks leave it "N/A")
LM_EVAL_MEASURES = {"score": "alignment", "score_stderr": "alignment_stderr_texts", "exact_match": "exact_match",
                    "first_error": "first_error", "a_accuracy": "a_accuracy", "b_accuracy": "b_accuracy"}  # fmt: skip


def from_lm_eval(results: Mapping[str, Any]) -> dict[str, Any]:
    """lm-eval's results of the `interleave_<N>w` tasks as a report: one row per length, the model lm-eval ran.

    Raises:
        KeyError: The results hold none of the project's tasks.
    """
    tasks = {int(m.group(1)): name for name in results["results"] if (m := re.fullmatch(r"interleave_(\d+)w", name))}
    if not tasks:
        raise KeyError("no interleave_<N>w task in these lm-eval results")
    rows = []
    for n, task in sorted(tasks.items()):
        values = {key.partition(",")[0]: value for key, value in results["results"][task].items() if "," in key}
        row = {"n_words": n, "pairs": results["n-samples"][task]["effective"], "texts": values.get("texts")}
        rows.append(row | {ours: _number(values.get(theirs)) for ours, theirs in LM_EVAL_MEASURES.items()})
    config = results["config"]
    args = config.get("model_args") or {}
    args = args if isinstance(args, Mapping) else dict(part.split("=", 1) for part in str(args).split(",") if part)
    metadata = DEFAULTS | (results["configs"][tasks[min(tasks)]].get("metadata") or {})
    chat = bool(results.get("chat_template")) or config.get("model") == "local-chat-completions"  # the server's
    model = args.get("pretrained") or args.get("model") or config.get("model")
    return {
        "split": "test",
        "created": datetime.fromtimestamp(float(results.get("date", 0)), timezone.utc).isoformat(timespec="seconds"),
        "model": {"model_name_or_path": model, "checkpoint": None, "global_step": None, "lora": None},
        "generation": {
            "engine": f"lm-eval {results.get('lm_eval_version')}, {config.get('model')}",
            "num_samples": 0,
            "chat_template": chat,
        },  # fmt: skip
        "data": {key: metadata[key] for key in ("corpus", "template", "seed")}
        | {"pairs_per_length": metadata["test_pairs"]},
        "run": {"lm_eval_version": results.get("lm_eval_version")},
        "lengths": rows,
    }


def _number(value: Any) -> float:
    """lm-eval writes "N/A" for a standard error it could not compute."""
    return float(value) if isinstance(value, int | float) else math.nan


def measures(report: Mapping[str, Any]) -> list[str]:
    """The measure names of a report's rows in table order: greedy, pass@k by k, the other sampled ones, the rest."""
    present = {k for row in report["lengths"] for k in row} - set(COUNTS)
    pass_k = sorted((k for k in present if k.startswith("pass@")), key=lambda k: int(k[5:]))
    greedy = [k for k in COLUMNS if k in present and k not in SAMPLED]
    sampled = [k for k in SAMPLED if k in present]
    return greedy + pass_k + sampled + sorted(present - set(greedy) - set(pass_k) - set(sampled))


def describe(report: Mapping[str, Any]) -> dict[str, str]:
    """One-line descriptions of the model, data and generation behind a report."""
    model, data, gen, run = report["model"], report["data"], report["generation"], report["run"]
    checkpoint = model.get("checkpoint") or "none (weights as loaded)"
    corpus = data.get("dataset_dir") or ", ".join(data.get("corpus") or ["pydoc_data.topics (default)"])
    sampling = "greedy only"
    if gen.get("num_samples"):
        correct = "exact match" if gen.get("pass_threshold", 1.0) >= 1.0 else f"score >= {gen['pass_threshold']}"
        sampling = (
            f"greedy; {gen['num_samples']} samples per prompt at temperature {gen['temperature']} "
            f"(top_p {gen['top_p']}, top_k {gen['top_k']}), correct = {correct}"
        )
    return {
        "model": f"{model.get('model_name_or_path')} (LoRA: {'yes' if model.get('lora') else 'no'})",
        "checkpoint": f"{checkpoint}, global step {model.get('global_step')}",
        "data": (
            f"split {report['split']}, corpus {corpus}, template {data.get('template')}, "
            f"data seed {data.get('seed')}, {data.get('pairs_per_length')} pairs per length"
        ),
        "generation": sampling,
        "run": (
            f"seed_everything {run.get('seed_everything')}, model seed {run.get('model_seed')}, "
            f"world size {run.get('world_size')}, written {report['created']}"
        ),
    }


def to_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown: what was evaluated, then one table row per length."""
    lines = [f"# Evaluation report ({report['split']})", ""]
    lines += [f"- **{name}**: {text}" for name, text in describe(report).items()]
    keys = [*_counts([report]), *measures(report)]
    lines += ["", "| " + " | ".join(COLUMNS.get(k, k) for k in keys) + " |"]
    lines.append("|" + "|".join("---:" for _ in keys) + "|")
    for row in report["lengths"]:
        lines.append("| " + " | ".join(_cell(row.get(k)) for k in keys) + " |")
    lines += [
        "",
        "texts: the texts the pairs were cut from; score: mean alignment score of the greedy answer; ± s.e.: its "
        "standard error over those texts (pairs that share a text are correlated; nan when every two pairs share "
        "one); exact: share of exact greedy answers; first error: mean position of the first departure from the "
        "target, as a share of its length (1 = never); A/B acc: target words of each fragment matched; sub/ins/del: "
        "edits per target word; length: answer words over target words; copies: share of answers that hold one "
        "stream only (one at least 80% matched, the other at most 20%); pass@k: chance that k samples hold a "
        "correct one; sample score: mean score of the samples; distinct: different answers per prompt; self-sim: "
        "mean pairwise score among a prompt's samples (1 = all the same).",
        "",
    ]
    return "\n".join(lines)


def curve_figure(report: Mapping[str, Any]):
    """Score vs length: greedy score, exact match, relative first-error position, and pass@k / sample score."""
    from matplotlib.figure import Figure

    rows = report["lengths"]
    x = [row["n_words"] for row in rows]
    figure = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = figure.add_subplot()
    series = [("score", "greedy score", "o-"), ("exact_match", "exact match", "s--"),
              ("first_error", "first error (share of length)", "^:")]  # fmt: skip
    series += [(k, k, "d-.") for k in measures(report) if k.startswith("pass@")][-1:]
    series += [("sample_score", "sample score", "x-")] if any("sample_score" in r for r in rows) else []
    for key, label, style in series:
        ax.plot(x, [row.get(key, math.nan) for row in rows], style, label=label)
    _length_axes(ax, x, "share")
    name = Path(str(report["model"].get("model_name_or_path"))).name
    ax.set_title(f"{report['split']}: {name}, step {report['model'].get('global_step')}")
    return figure


def compare(reports: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    """Reports side by side, one line per length and measure, with the difference to the first report."""
    labels = [chr(ord("A") + i) for i in range(len(reports))]
    lines = []
    for label, name, report in zip(labels, names, reports, strict=True):
        info = describe(report)
        lines.append(f"{label}: {name}")
        lines += [f"   {key}: {info[key]}" for key in ("model", "checkpoint", "data", "generation")]
    lines += _data_differences(reports, labels)
    keys = _counts(reports)[1:] + list(dict.fromkeys(k for report in reports for k in measures(report)))
    header = ["words", "measure", *labels, *(f"{label}-A" for label in labels[1:])]
    table = [header]
    rows = [{row["n_words"]: row for row in report["lengths"]} for report in reports]
    for n in sorted({n for by_length in rows for n in by_length}):
        for i, key in enumerate(keys):
            values = [by_length.get(n, {}).get(key) for by_length in rows]
            deltas = [_delta(values[0], v, key) for v in values[1:]]
            table.append([str(n) if i == 0 else "", key, *(_cell(v) for v in values), *deltas])
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    lines.append("")
    for r in table:
        cells = [r[0].rjust(widths[0]), r[1].ljust(widths[1])]
        cells += [value.rjust(width) for value, width in zip(r[2:], widths[2:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def comparison_figure(reports: Sequence[Mapping[str, Any]], names: Sequence[str]):
    """The reports' greedy score against length, one curve each with its standard error as a band."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = figure.add_subplot()
    lengths = sorted({row["n_words"] for report in reports for row in report["lengths"]})
    for label, name, report in zip((chr(ord("A") + i) for i in range(len(reports))), names, reports, strict=False):
        rows = report["lengths"]
        x = [row["n_words"] for row in rows]
        y = [row.get("score", math.nan) for row in rows]
        ax.plot(x, y, "o-", label=f"{label}: {name}")
        error = [row.get("score_stderr", math.nan) for row in rows]
        low, high = [a - e for a, e in zip(y, error, strict=True)], [a + e for a, e in zip(y, error, strict=True)]
        ax.fill_between(x, low, high, alpha=0.2)
    _length_axes(ax, lengths, "greedy alignment score")
    return figure


def _length_axes(ax, lengths: Sequence[int], ylabel: str) -> None:
    """A score-vs-length plot's axes: the lengths as ticks (a log scale when they span 4x or more), shares 0 to 1."""
    if len(lengths) > 1 and max(lengths) / min(lengths) >= 4:
        ax.set_xscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("words per fragment")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m interleave_model.evaluation.report A.json B.json ...`: print the reports side by side."""
    parser = argparse.ArgumentParser(prog="python -m interleave_model.evaluation.report", description=compare.__doc__)
    parser.add_argument("reports", nargs="+", help="report.json files, run / eval folders, or lm-eval's results")
    parser.add_argument("--plot", help="also draw the score-vs-length curves into this PNG file")
    parser.add_argument("--names", nargs="+", help="a short name for each report (default: its path)")
    args = parser.parse_args(argv)
    names = args.names or args.reports
    if len(names) != len(args.reports):
        parser.error(f"--names gives {len(names)} names for {len(args.reports)} reports")
    try:
        reports = [load_report(path) for path in args.reports]
    except (OSError, json.JSONDecodeError, KeyError) as err:
        print(f"error: cannot read report: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(compare(reports, names))
    if args.plot:
        save_figure(comparison_figure(reports, names), args.plot)
    return 0


def _data_differences(reports: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[str]:
    """A warning line per data or generation setting that differs, since such numbers are not comparable."""
    lines = []
    for section in ("data", "generation"):
        for key in sorted({k for r in reports for k in r[section]}):
            values = [r[section].get(key) for r in reports]
            if any(v != values[0] for v in values[1:]):
                shown = ", ".join(f"{label} {json.dumps(v)}" for label, v in zip(labels, values, strict=True))
                lines.append(f"note: {section}.{key} differs: {shown}")
    if len({r["split"] for r in reports}) > 1:
        lines.append("note: the reports evaluate different splits")
    return lines


def _counts(reports: Sequence[Mapping[str, Any]]) -> list[str]:
    """The counts that lead a table: the length, its pairs and the texts (reports from before the texts were counted,
    and lm-eval results from before the tasks counted them, have none)."""
    has_texts = any(row.get("texts") is not None for report in reports for row in report["lengths"])
    return [key for key in COUNTS if key != "texts" or has_texts]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def _delta(first: Any, value: Any, key: str) -> str:
    if not isinstance(first, int | float) or not isinstance(value, int | float) or key in COUNTS:
        return ""
    diff = value - first
    return "" if math.isnan(diff) else f"{diff:+.3f}"


if __name__ == "__main__":
    sys.exit(main())

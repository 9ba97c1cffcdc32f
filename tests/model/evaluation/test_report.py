"""Evaluation reports: a tiny model's report on two lengths, the Markdown table, and the side-by-side comparison."""

import json
import math

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from interleave_model.evaluation.evaluator import GREEDY_KEYS
from interleave_model.evaluation.report import build_report, compare, load_report, main, to_markdown, write_report
from interleave_model.run.writers import EvaluationReport

SAMPLED_KEYS = ("pass@1", "pass@2", "sample_score", "distinct", "self_similarity")


def _trainer(tmp_path):
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(tmp_path, name="run", version=0),
        callbacks=[EvaluationReport()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_tiny_model_report_on_two_lengths_has_every_field(make_module, make_datamodule, tmp_path):
    module = make_module(evaluation={"num_samples": 2, "temperature": 1.0})
    datamodule = make_datamodule(module.tokenizer)  # lengths 4 and 8, 4 val / test pairs each
    trainer = _trainer(tmp_path)
    trainer.validate(module, datamodule=datamodule, verbose=False)

    run = tmp_path / "run" / "version_0"
    report = load_report(run)  # a run folder finds eval/report.json
    assert set(report) == {"split", "created", "model", "generation", "data", "run", "lengths"}
    assert report["split"] == "val"
    assert report["model"]["model_name_or_path"] == "tiny"
    assert report["model"]["checkpoint"] is None and report["model"]["global_step"] == 0
    assert report["model"]["hparams"]["tiny"]["hidden_size"] == 32  # every hyperparameter, dataclasses as objects
    assert report["generation"] | {"pass_k": None} == {
        "max_new_tokens": None, "budget_margin": 0.25, "num_samples": 2, "temperature": 1.0, "top_p": 1.0,
        "top_k": 0, "pass_k": None, "pass_threshold": 1.0,
    }  # fmt: skip
    assert report["generation"]["pass_k"] == [1, 2]
    assert report["data"] | {"split_fractions": None} == {
        "corpus": None, "dataset_dir": None, "template": "compact", "seed": 0, "eval_stages": [4, 8],
        "pairs_per_length": 4, "split_fractions": None,
    }  # fmt: skip
    assert set(report["run"]) == {"seed_everything", "model_seed", "world_size", "precision", "versions"}
    assert report["run"]["world_size"] == 1
    assert [row["n_words"] for row in report["lengths"]] == [4, 8]
    for row in report["lengths"]:
        assert set(row) == {"n_words", "pairs", "texts", *GREEDY_KEYS, *SAMPLED_KEYS}
        assert row["pairs"] == 4 and 2 <= row["texts"] <= 8  # the validation texts the 4 pairs were cut from
        for key in ("score", "exact_match", "first_error", "a_accuracy", "b_accuracy", "pass@1", "pass@2"):
            assert 0.0 <= row[key] <= 1.0, key
        assert 1.0 <= row["distinct"] <= 2.0
        assert row["pass@1"] <= row["pass@2"]

    markdown = (run / "eval" / "report.md").read_text()
    assert "| words | pairs | texts | score | ± s.e. | exact | first error |" in markdown
    assert "| pass@1 | pass@2 | sample score | distinct | self-sim |" in markdown
    assert sum(line.startswith("| 4 |") or line.startswith("| 8 |") for line in markdown.splitlines()) == 2
    assert (run / "eval" / "curve.png").read_bytes()[:4] == b"\x89PNG"

    events = EventAccumulator(str(run))
    events.Reload()
    assert "val/curve" in events.Tags()["images"]
    scalars = set(events.Tags()["scalars"])
    for n in (4, 8):
        names = ("alignment", *GREEDY_KEYS[1:], *SAMPLED_KEYS)
        assert {f"val/{name}_{n}w" for name in names} <= scalars

    trainer.test(module, datamodule=datamodule, verbose=False)
    report = load_report(run / "eval" / "report.json")
    assert report["split"] == "test" and len(report["lengths"]) == 2


def test_greedy_only_report_has_no_sampled_columns(make_module, make_datamodule, tmp_path):
    module = make_module()
    trainer = _trainer(tmp_path)
    trainer.validate(module, datamodule=make_datamodule(module.tokenizer, stages=(4,)), verbose=False)
    report = load_report(tmp_path / "run" / "version_0" / "eval")
    assert report["generation"]["num_samples"] == 0
    assert [set(row) for row in report["lengths"]] == [{"n_words", "pairs", "texts", *GREEDY_KEYS}]


def _report(score: float, seed: int = 0, step: int = 0) -> dict:
    rows = [
        {"n_words": n, "pairs": 32, **dict.fromkeys(GREEDY_KEYS, score / k), "pass@1": score, "pass@8": 1.0}
        for k, n in enumerate((10, 25), start=1)
    ]
    rows[1]["self_similarity"] = math.nan
    data = {"corpus": None, "template": "two_processes", "seed": seed, "pairs_per_length": 32}
    generation = {"num_samples": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "pass_threshold": 1.0}
    model = {"model_name_or_path": "/models/Llama-3.2-3B-Instruct", "lora": None, "checkpoint": None}
    return build_report(
        {"split": "val", "step": step, "lengths": rows}, model | {"global_step": step}, generation, data, {}
    )


def test_markdown_table_by_hand():
    markdown = to_markdown(_report(0.5))
    lines = markdown.splitlines()
    header = "| words | pairs | score | ± s.e. | exact | first error | A acc | B acc | sub/word | ins/word | del/word"
    assert lines[lines.index(next(line for line in lines if line.startswith("| words")))].startswith(header)
    assert "| del/word | length | copies | pass@1 | pass@8 | self-sim |" in markdown  # pass@k after the greedy ones
    assert "| 10 | 32 | 0.500 | 0.500 |" in markdown
    assert "| 25 | 32 | 0.250 |" in markdown and markdown.count("| nan |") == 1
    assert "- **model**: /models/Llama-3.2-3B-Instruct (LoRA: no)" in markdown
    assert "8 samples per prompt at temperature 1.0 (top_p 1.0, top_k 0), correct = exact match" in markdown


def test_compare_prints_two_reports_side_by_side(tmp_path, capsys):
    a = write_report(_report(0.5), tmp_path / "a")
    write_report(_report(0.75, seed=1, step=100), tmp_path / "b")
    assert math.isnan(json.loads(a.read_text())["lengths"][1]["self_similarity"])  # NaN survives the round trip

    assert main([str(a), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert f"A: {a}" in out and f"B: {tmp_path / 'b'}" in out
    assert "checkpoint: none (weights as loaded), global step 100" in out
    assert "note: data.seed differs: A 0, B 1" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("words"))
    assert header.split() == ["words", "measure", "A", "B", "B-A"]
    pairs_10 = lines.index(next(line for line in lines if line.split()[:2] == ["10", "pairs"]))
    assert lines[pairs_10].split() == ["10", "pairs", "32", "32"]  # counts, no difference column
    assert lines[pairs_10 + 1].split() == ["score", "0.500", "0.750", "+0.250"]
    pairs_25 = lines.index(next(line for line in lines if line.split()[:2] == ["25", "pairs"]))
    assert lines[pairs_25 + 1].split() == ["score", "0.250", "0.375", "+0.125"]
    assert lines[pairs_25 + len(GREEDY_KEYS) + 1].split() == ["pass@1", "0.500", "0.750", "+0.250"]  # after the greedy
    assert lines[-1].split() == ["self_similarity", "nan", "nan"]


def test_compare_three_reports_and_missing_lengths():
    short = _report(1.0)
    short["lengths"] = short["lengths"][:1]
    out = compare([_report(0.5), _report(0.5), short], ["x", "y", "z"])
    assert any(line.split() == ["25", "pairs", "32", "32", "-"] for line in out.splitlines())
    assert any(line.split()[:3] == ["10", "pairs", "32"] for line in out.splitlines())


def test_compare_command_reports_unreadable_files(tmp_path, capsys):
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read report" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["report.json", "report.md"])
def test_reports_are_written_whole(tmp_path, name):
    write_report(_report(0.5), tmp_path)
    write_report(_report(0.75), tmp_path)  # replaced, and no temporary file is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]
    assert "0.750" in (tmp_path / "report.md").read_text()


def _lm_eval_results(scores: dict[int, float], model: str = "local-chat-completions") -> dict:
    """lm-eval 0.4.13's results file of the project's tasks, in the fields it writes (a served model's): "N/A" for its
    own standard errors, which the tasks' averages do not get, and the tasks' standard error over texts."""
    tasks = {f"interleave_{n}w": n for n in scores}
    results = {task: {"alias": task, "alignment,none": scores[n], "alignment_stderr,none": "N/A",
                      "exact_match,none": 0.0, "exact_match_stderr,none": "N/A", "a_accuracy,none": 0.5,
                      "a_accuracy_stderr,none": "N/A", "b_accuracy,none": 0.25, "b_accuracy_stderr,none": "N/A",
                      "first_error,none": 0.125, "first_error_stderr,none": "N/A",
                      "alignment_stderr_texts,none": 0.01, "alignment_stderr_texts_stderr,none": "N/A",
                      "texts,none": 8 - n // 25, "texts_stderr,none": "N/A"}
               for task, n in tasks.items()}  # fmt: skip
    return {"results": results, "n-samples": {task: {"original": 128, "effective": 128} for task in tasks},
            "configs": {task: {"metadata": {"version": 1.0, "test_pairs": 128, "model": "llama"}} for task in tasks},
            "config": {"model": model, "model_args": {"model": "llama", "base_url": "http://h/v1/chat/completions"}},
            "lm_eval_version": "0.4.13", "date": 1795949800.0, "chat_template": None}  # fmt: skip


def test_lm_eval_results_stand_beside_a_report_and_plot(tmp_path, capsys):
    folder = tmp_path / "lm_eval" / "llama"
    folder.mkdir(parents=True)
    (folder / "results_2026-11-29T10-00-00.json").write_text(json.dumps(_lm_eval_results({25: 0.125, 10: 0.75})))
    ours = write_report(_report(0.5), tmp_path / "ours")

    served = load_report(tmp_path / "lm_eval")  # the --output_path folder finds its results file

    assert served["split"] == "test" and served["model"]["model_name_or_path"] == "llama"
    assert served["data"] == {"corpus": None, "template": "two_processes", "seed": 0, "pairs_per_length": 128}
    assert served["generation"]["chat_template"] is True  # a chat-completions server applies the template
    row10, row25 = served["lengths"]
    assert (row10["n_words"], row10["pairs"], row10["score"], row10["score_stderr"]) == (10, 128, 0.75, 0.01)
    assert row25["score"] == 0.125 and row10["first_error"] == 0.125 and row10["a_accuracy"] == 0.5
    assert (row10["texts"], row25["texts"]) == (8, 7)
    plot = tmp_path / "curves.png"
    assert main([str(ours), str(tmp_path / "lm_eval"), "--names", "ours", "served", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "A: ours" in out and "B: served" in out
    assert any(line.split() == ["score", "0.500", "0.750", "+0.250"] for line in out.splitlines())
    assert any(line.split() == ["texts", "-", "8"] for line in out.splitlines())  # a count: no difference
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lm_eval_results_of_the_tasks_before_texts_give_no_standard_error(tmp_path):
    # tasks 1.0 averaged by lm-eval's `mean`, whose standard error treats the pairs as independent: not read as ours
    results = _lm_eval_results({10: 0.75})
    for key in ("alignment_stderr_texts,none", "alignment_stderr_texts_stderr,none", "texts,none", "texts_stderr,none"):
        del results["results"]["interleave_10w"][key]
    results["results"]["interleave_10w"]["alignment_stderr,none"] = 0.01
    (tmp_path / "results_x.json").write_text(json.dumps(results))
    (row,) = load_report(tmp_path)["lengths"]
    assert math.isnan(row["score_stderr"]) and row["texts"] is None
    assert "| words | pairs | score | ± s.e. |" in to_markdown(load_report(tmp_path))


def test_lm_eval_results_without_the_tasks_are_refused(tmp_path, capsys):
    results = _lm_eval_results({10: 0.5})
    results["results"] = {"gsm8k": {"exact_match,none": 0.3}}
    (tmp_path / "results_x.json").write_text(json.dumps(results))
    assert main([str(tmp_path / "results_x.json")]) == 2
    assert "no interleave_<N>w task" in capsys.readouterr().err

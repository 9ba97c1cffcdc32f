"""The lm-eval tasks: their documents are `cli.py test`'s pairs, their aggregates `cli.py test`'s (the standard error
over texts included), and each pair's score through lm-eval's hf backend equals the project's own on the same model:
the tiny model through `cli.py export` and the family folders (SmolLM2, and served models:
tests/model/evaluation/test_lm_eval_served.py)."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import yaml

from cli import main
from interleave_data.datamodule import InterleaveDataModule
from interleave_data.prompts import format_prompt
from interleave_model.evaluation.lm_eval_tasks import DEFAULTS, FOLDER, LENGTHS, METRICS, TEXT_METRICS
from interleave_model.evaluation.lm_eval_tasks.documents import load
from interleave_model.evaluation.metric import AlignmentScore
from interleave_model.generation.rollout import answer_budget
from tests.conftest import TINY_CONFIG

EVAL_CONFIG = Path(__file__).parents[3] / "configs" / "eval.yaml"
PAIRS = 3


def _task(name: str) -> dict:
    text = (FOLDER / name).read_text().replace("!function", "")  # lm-eval's tag for its function references
    return yaml.safe_load(text)


def test_one_task_per_curriculum_length_with_the_held_out_budget():
    assert LENGTHS == tuple(InterleaveDataModule().stages)
    assert _task("interleave.yaml")["task"] == [f"interleave_{n}w" for n in LENGTHS]
    assert [m["metric"] for m in _task("_template_yaml")["metric_list"]] == [*METRICS, *TEXT_METRICS]
    for n in LENGTHS:
        task = _task(f"interleave_{n}w.yaml")
        assert task["dataset_kwargs"] == {"n_words": n}
        assert task["generation_kwargs"] == {"do_sample": False, "temperature": 0.0, "max_gen_toks": answer_budget(n),
                                             "until": []}  # fmt: skip


@pytest.mark.parametrize("metadata", [{}, {"seed": 3, "test_pairs": 5, "template": "compact"}])
def test_documents_are_the_test_pairs_of_cli_test(metadata, tmp_path):
    data = {"seed": 0, "test_pairs": DEFAULTS["test_pairs"]} | metadata
    datamodule = InterleaveDataModule(stages=[25], seed=data["seed"], test_pairs=data["test_pairs"], train_pairs=1,
                                      cache_dir=str(tmp_path))  # fmt: skip
    datamodule.prepare_data()
    datamodule.setup("test")

    docs = load(25, **metadata, pretrained="ignored", version=1.0)["test"]

    examples = datamodule.examples(25, "test")
    assert len(docs) == len(examples) == data["test_pairs"]
    assert docs["id"] == [e.id for e in examples] and docs["target"] == [e.target for e in examples]
    template = metadata.get("template", "two_processes")
    assert docs["prompt"] == [format_prompt(e.a, e.b, template) for e in examples]


def test_cli_test_s_default_pairs_are_the_first_of_lm_eval_s(tmp_path):
    """The defaults differ, as docs/EVALUATION.md says: lm-eval's 128 pairs a length (the project's held-out results)
    are `cli.py test --data.test_pairs 128`'s, and `cli.py test`'s 32 (the data module's and configs/eval.yaml's) are
    their first 32, lm-eval's with `--metadata '{"test_pairs": 32}'`."""
    default = inspect.signature(InterleaveDataModule).parameters["test_pairs"].default
    eval_config = yaml.safe_load(EVAL_CONFIG.read_text())["data"]["test_pairs"]
    assert (DEFAULTS["test_pairs"], default, eval_config) == (128, 32, 32)
    datamodule = InterleaveDataModule(stages=[25], train_pairs=1, cache_dir=str(tmp_path))
    datamodule.prepare_data()
    datamodule.setup("test")

    docs = load(25)["test"]

    assert len(docs) == 128 and docs["id"][:default] == [e.id for e in datamodule.examples(25, "test")]


def _answer(doc: dict, index: int) -> str:
    """Answers of every kind: right, one fragment copied, cut short, empty."""
    return [doc["target"], doc["a"], " ".join(doc["target"].split()[: 10 + index]), ""][index % 4]


def test_lm_eval_aggregates_are_cli_test_s_on_the_same_pairs():
    from lm_eval.api.metrics import stderr_for_metric
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(FOLDER), include_defaults=False, metadata={"test_pairs": 24})
    task = manager.load(["interleave_25w"])["tasks"]["interleave_25w"]
    docs = list(task.test_docs())
    answers = [_answer(doc, i) for i, doc in enumerate(docs)]

    per_pair = [task.process_results(doc, [answer]) for doc, answer in zip(docs, answers, strict=True)]
    ours = AlignmentScore()
    ours.update(answers, [doc["target"] for doc in docs], [(doc["text_a"], doc["text_b"]) for doc in docs])

    theirs = {name: aggregate([pair[name] for pair in per_pair]) for name, aggregate in task.aggregation().items()}
    values = ours.compute_all()
    assert len(docs) == 24 and theirs["texts"] == values["texts"].item() == 8  # the test split's texts
    assert theirs["alignment"] == pytest.approx(values["score"].item())
    assert theirs["exact_match"] == pytest.approx(values["exact_match"].item())
    assert theirs["alignment_stderr_texts"] == pytest.approx(values["score_stderr"].item())
    assert not math.isnan(theirs["alignment_stderr_texts"])
    # lm-eval adds no standard error of its own (over independent pairs): it writes "N/A" for every measure
    assert all(stderr_for_metric(task.aggregation()[name], bootstrap_iters=100000) is None for name in METRICS)


def test_a_corpus_file_and_a_bad_template_through_metadata(tmp_path):
    corpus = tmp_path / "texts.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(f"w{i}x{j}" for j in range(40))}) + "\n" for i in range(30)))

    docs = load(10, corpus=str(corpus), test_pairs=2)["test"]

    assert len(docs) == 2 and all(word.startswith("w") for word in docs["target"][0].split())
    with pytest.raises(ValueError, match="template: unknown 'chatty'"):
        load(10, template="chatty")


def lm_eval_samples(folder: Path, chat: bool, template: str) -> dict[str, dict]:
    """lm-eval's hf backend, greedy, on the first `PAIRS` pairs of `interleave_10w`: each pair's record by id."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(FOLDER), metadata={"test_pairs": PAIRS, "template": template})
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, batch_size=1,
        tasks=["interleave_10w"], task_manager=manager, log_samples=True, apply_chat_template=chat,
    )  # fmt: skip
    return {sample["doc"]["id"]: sample for sample in out["samples"]["interleave_10w"]}


def project_records(args: list[str], tmp_path: Path) -> dict[str, dict]:
    """`cli.py predict` on the test pairs of 10 words, one prompt a batch (the backend's batch size above)."""
    cli = main(["predict", *args, "--data.eval_stages=[10]", f"--data.test_pairs={PAIRS}", "--data.eval_batch_size=1",
                "--model.evaluation.num_samples=0", f"--trainer.default_root_dir={tmp_path}",
                f"--data.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    lines = (Path(cli.trainer.log_dir) / "predictions.jsonl").read_text().splitlines()
    return {record["id"]: record for record in map(json.loads, lines)}


def assert_agree(ours: dict[str, dict], theirs: dict[str, dict]) -> None:
    assert sorted(ours) == sorted(theirs) and len(ours) == PAIRS
    for pair, record in ours.items():
        sample = theirs[pair]
        assert " ".join(sample["filtered_resps"][0].split()) == record["completion"], pair
        assert sample["alignment"] == record["score"] and sample["first_error"] == record["relative_first_error"]
        assert (sample["a_accuracy"], sample["b_accuracy"]) == (record["a_accuracy"], record["b_accuracy"])
        assert sample["exact_match"] == float(record["exact_match"])


@pytest.mark.slow
def test_the_tiny_model_through_export_scores_the_same(tmp_path):
    main(["fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}",
          f"--data.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    (checkpoint,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    main(["export", "--config", str(TINY_CONFIG), f"--ckpt_path={checkpoint}", f"--output_dir={tmp_path / 'hf'}"])

    ours = project_records(["--config", str(TINY_CONFIG), f"--ckpt_path={checkpoint}"], tmp_path)
    assert_agree(ours, lm_eval_samples(tmp_path / "hf", chat=False, template="compact"))


@pytest.mark.slow
def test_family_folders_score_the_same(family, tmp_path):
    name, folder = family
    args = ["--config", str(EVAL_CONFIG), f"--model.base.name_or_path={folder}", "--model.base.dtype=float32"]
    ours = project_records(args, tmp_path)
    chat = name != "gpt2"  # the GPT-2 folder has no chat template: plain text on both paths
    assert_agree(ours, lm_eval_samples(folder, chat=chat, template="two_processes"))

"""The evaluation commands end to end: validate on a saved checkpoint, predict, export, and configs/eval.yaml."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import cli
from cli import main
from interleave_model.evaluation.alignment import align
from tests.conftest import TINY_CONFIG

EVAL_CONFIG = Path(__file__).parents[1] / "configs" / "eval.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step fit of the tiny config: its folder and its checkpoint."""
    root = tmp_path_factory.mktemp("run")
    torch.set_num_threads(1)
    main(_args("fit", root))
    (checkpoint,) = root.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    return root, checkpoint


def _args(command: str, root: Path, *extra: str) -> list[str]:
    return [command, "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={root}",
            f"--data.cache_dir={root / 'cache'}", *extra]  # fmt: skip


def test_validate_a_checkpoint_writes_the_report(run):
    root, checkpoint = run
    cli = main(_args("validate", root, f"--ckpt_path={checkpoint}", "--model.evaluation.num_samples=2"))

    report = json.loads((Path(cli.trainer.log_dir) / "eval" / "report.json").read_text())
    assert report["split"] == "val"
    assert report["model"]["checkpoint"] == str(checkpoint)
    assert report["model"]["global_step"] == 4  # the checkpoint's step, not the validate loop's 0
    assert report["run"]["seed_everything"] == 0
    assert [(row["n_words"], row["pairs"]) for row in report["lengths"]] == [(4, 4), (8, 4)]
    assert {"pass@1", "pass@2", "distinct", "self_similarity"} <= set(report["lengths"][0])
    assert (Path(cli.trainer.log_dir) / "eval" / "report.md").exists()


def test_predict_writes_one_json_line_per_example(run):
    root, checkpoint = run
    cli = main(_args("predict", root, f"--ckpt_path={checkpoint}"))

    path = Path(cli.trainer.log_dir) / "predictions.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    examples = [e for n in (4, 8) for e in cli.datamodule.examples(n, "test")]
    assert [r["id"] for r in records] == [e.id for e in examples]  # every test example once, in loader order
    for record, example in zip(records, examples, strict=True):
        assert record["target"] == example.target and record["prompt"].startswith("A: ")
        diagnostics = align(record["completion"], record["target"])
        assert record["score"] == diagnostics.score and record["first_error"] == diagnostics.first_error
        assert {"a_accuracy", "b_accuracy", "substitutions", "insertions", "deletions", "exact_match"} <= set(record)
    assert sorted(p.name for p in path.parent.iterdir() if "predictions" in p.name) == ["predictions.jsonl"]


def test_predict_to_a_chosen_file_with_samples(run, tmp_path):
    root, checkpoint = run
    out = tmp_path / "out" / "preds.jsonl"
    main(_args("predict", root, f"--ckpt_path={checkpoint}", f"--predictions.output_path={out}",
               "--model.evaluation.num_samples=2", "--data.eval_stages=[4]"))  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 and all(len(r["samples"]) == len(r["sample_scores"]) == 2 for r in records)


def test_export_a_checkpoint_loads_with_from_pretrained(run, tmp_path):
    root, checkpoint = run
    main(["export", "--config", str(TINY_CONFIG), f"--ckpt_path={checkpoint}", f"--output_dir={tmp_path / 'hf'}"])

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = torch.load(checkpoint, map_location="cpu", weights_only=False)
    weights = {k.removeprefix("policy."): v for k, v in trained["state_dict"].items() if k.startswith("policy.")}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0, msg=name)
    info = json.loads((tmp_path / "hf" / "export.json").read_text())
    assert info["checkpoint"] == str(checkpoint) and info["global_step"] == 4


def test_export_into_a_folder_of_other_files_is_refused_in_one_line(run, tmp_path, capsys):
    root, checkpoint = run
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own")

    args = ["export", "--config", str(TINY_CONFIG), f"--ckpt_path={checkpoint}", f"--output_dir={mine}"]
    assert cli.run(args) == 2

    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {mine}: exists and is not a folder this writes; choose a new or an empty folder"
    ]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_eval_config_evaluates_an_untrained_model(tmp_path):
    """configs/eval.yaml as shipped (the untrained tiny model), cut down to one short length."""
    cli = main(["validate", "--config", str(EVAL_CONFIG), f"--trainer.logger.init_args.save_dir={tmp_path}",
                "--data.stages=[4]", "--data.val_pairs=2", f"--data.cache_dir={tmp_path / 'cache'}",
                "--model.evaluation.num_samples=2", "--model.evaluation.pass_k=[1, 2]"])  # fmt: skip
    report = json.loads((Path(cli.trainer.log_dir) / "eval" / "report.json").read_text())
    assert Path(cli.trainer.log_dir).parent.name == "eval"
    assert report["data"]["template"] == "two_processes" and report["generation"]["pass_k"] == [1, 2]
    assert [(row["n_words"], row["pairs"]) for row in report["lengths"]] == [(4, 2)]

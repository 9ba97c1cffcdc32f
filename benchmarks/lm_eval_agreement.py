"""One model measured by `cli.py test` and by lm-eval's hf backend on the same test pairs. Prints one JSON line.

The lm-eval side runs the project's tasks (`interleave_<N>w`, interleave_model/evaluation/lm_eval_tasks) with the same
pairs, template, greedy decoding and held-out budget; the line gives each length's score, standard error and exact
match by both, and the seconds each took.

    python benchmarks/lm_eval_agreement.py --model smollm2-135m-instruct --lengths 10 25 50
    python benchmarks/lm_eval_agreement.py --config configs/curriculum.yaml --ckpt RUN/checkpoints/last.ckpt \
        --lengths 10 25 50 100      # a trained tiny model, exported for lm-eval with `cli.py export`
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import harness
import torch
from provenance import provenance

from cli import main as cli_main
from interleave_model.evaluation.lm_eval_tasks import FOLDER
from interleave_model.model.shipped import resolve_model

MEASURES = {"score": ("score", "alignment,none"), "stderr": ("score_stderr", "alignment_stderr_texts,none"),
            "exact_match": ("exact_match", "exact_match,none")}  # fmt: skip


def project_rows(args: argparse.Namespace, model_args: list[str], root: Path) -> dict[int, dict]:
    """`cli.py test` at each length: its report's rows, by length."""
    lengths = "[" + ",".join(map(str, args.lengths)) + "]"
    cli = cli_main(["test", *model_args, f"--data.eval_stages={lengths}", f"--data.test_pairs={args.pairs}",
                    f"--data.eval_batch_size={args.batch_size}", "--model.evaluation.num_samples=0",
                    f"--trainer.default_root_dir={root}", f"--data.cache_dir={root / 'cache'}",
                    "--trainer.enable_progress_bar=false"])  # fmt: skip
    report = json.loads((Path(cli.trainer.log_dir) / "eval" / "report.json").read_text())
    return {row["n_words"]: row for row in report["lengths"]}


def lm_eval_rows(args: argparse.Namespace, folder: Path) -> dict[int, dict]:
    """lm-eval's hf backend on the same pairs: each task's results, by length."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoConfig, AutoTokenizer

    from interleave_model.model.positions import refuse_coupled

    refuse_coupled(AutoConfig.from_pretrained(folder), "lm-eval's hf backend")
    chat = bool(getattr(AutoTokenizer.from_pretrained(folder), "chat_template", None))
    manager = TaskManager(include_path=str(FOLDER), metadata={"test_pairs": args.pairs, "template": args.template})
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu"},
        batch_size=args.batch_size, tasks=[f"interleave_{n}w" for n in args.lengths], task_manager=manager,
        apply_chat_template=chat,
    )  # fmt: skip
    return {n: out["results"][f"interleave_{n}w"] | {"pairs": out["n-samples"][f"interleave_{n}w"]["effective"]}
            for n in args.lengths}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/eval.yaml")
    parser.add_argument("--model", help="a model folder or shipped name (with the eval config)")
    parser.add_argument("--ckpt", help="a checkpoint of --config's model instead, exported for lm-eval")
    parser.add_argument("--template", default=None, help="the prompt template (default: the config's)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 25, 50])
    parser.add_argument("--pairs", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also append the JSON line to this file")
    args = parser.parse_args()
    if (args.model is None) == (args.ckpt is None):
        parser.error("give --model or --ckpt")
    torch.set_num_threads(args.threads)
    import yaml

    args.template = args.template or yaml.safe_load(Path(args.config).read_text())["data"]["template"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.ckpt:
            folder = root / "export"
            cli_main(["export", "--config", args.config, f"--ckpt_path={args.ckpt}", f"--output_dir={folder}"])
            model_args = ["--config", args.config, f"--ckpt_path={args.ckpt}"]
        else:
            folder = Path(resolve_model(args.model))
            model_args = ["--config", args.config, f"--model.base.name_or_path={args.model}"]
            model_args.append("--model.base.dtype=float32")
        model_args.append(f"--data.template={args.template}")
        start = time.perf_counter()
        ours = project_rows(args, model_args, root)
        middle = time.perf_counter()
        theirs = lm_eval_rows(args, folder)
        end = time.perf_counter()
    rows = []
    for n in args.lengths:
        row = {"n_words": n, "pairs": [ours[n]["pairs"], theirs[n]["pairs"]]}
        for name, (key, their_key) in MEASURES.items():
            row[name] = [round(ours[n][key], 4), round(theirs[n][their_key], 4)]
        rows.append(row)
    line = {"benchmark": "lm_eval_agreement", "model": args.model or args.ckpt, "template": args.template,
            "order": ["cli.py test", "lm-eval hf"], "lengths": rows,
            "seconds": [round(middle - start, 1), round(end - middle, 1)], **provenance(args.threads)}  # fmt: skip
    harness.emit(line, args.out)


if __name__ == "__main__":
    main()

"""The GPU figures README's "On a GPU" and docs/SCALING.md quote for Llama-3.2-3B: one JSON line per config and stage.

Each stage's prompt and answer-budget tokens are measured as `python cli.py check` measures them (the config's
corpus, template and budget rules), with a byte-level BPE tokenizer and chat template: SmolLM2's, shipped, since
Llama-3.2's is gated (`--tokenizer` takes a folder of the real one). The figures are then `check --rehearse`'s
estimates (`interleave_model.preflight.estimates`) for Llama-3.2-3B's shape: the step's memory on an 80 GB H100 (or
`--gib`), its time from the steps measured on one H200 with the own sampler, and the hours of `--steps` GRPO steps at
the stage. Estimates, not measurements: a results row says so.

    python benchmarks/gpu_estimates.py [--configs configs/llama-3.2-3b.yaml configs/llama-3.2-3b-curriculum.yaml]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from pathlib import Path

import harness
import yaml
from provenance import provenance

ROOT = Path(__file__).parents[1]
CONFIGS = ["configs/llama-3.2-3b.yaml", "configs/llama-3.2-3b-curriculum.yaml"]


def stage_tokens(config: str, tokenizer: str, cache_dir: str) -> dict[int, tuple[int, int]]:
    """Each stage's longest prompt and answer budget in tokens, as `cli.py check` finds them for `tokenizer`."""
    from cli import main
    from interleave_model.preflight.checks import stage_fits

    # the own sampler for check's one greedy answer: the token counts and budgets do not depend on the engine
    args = ["check", "--config", str(ROOT / config), "--model.base.name_or_path", tokenizer,
            "--model.rollout_engine", "own", f"--data.cache_dir={cache_dir}"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # its report: the lines below carry what is used of it
        cli = main(args)
    fits = {f.n_words: (f.prompt_tokens, f.answer_tokens) for f in stage_fits(cli.model, cli.datamodule)}
    return {n: fits[n] for n in cli.datamodule.stages}


def main(argv: list[str] | None = None) -> None:
    from transformers import LlamaConfig

    from interleave_model.preflight.estimates import DEFAULT_GPU_GIB, estimate_stages

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct", help="a model folder or shipped name")
    parser.add_argument("--gib", type=float, default=DEFAULT_GPU_GIB, help="the GPU's memory (default an H100 80 GB)")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps a stage, for the hours column")
    parser.add_argument("--out", help="append the lines to this file too")
    args = parser.parse_args(argv)
    model = LlamaConfig(**harness.RANDOM_SHAPES["llama-3.2-3b"])
    with tempfile.TemporaryDirectory(prefix="gpu-estimates-") as cache_dir:
        for config_file in args.configs:
            config = yaml.safe_load((ROOT / config_file).read_text())
            tokens = stage_tokens(config_file, args.tokenizer, cache_dir)
            for e in estimate_stages(config, tokens, model, args.gib):
                m = e.memory
                line = {
                    "benchmark": "gpu_estimates", "config": config_file, "model": "llama-3.2-3b (shape)",
                    "tokenizer": args.tokenizer, "estimate": True, "words": e.words,
                    "prompt_tokens": e.prompt_tokens, "answer_tokens": e.answer_tokens, "rows": e.rows,
                    "gpu_gib": round(args.gib, 1), "trainer_gib": round(m.trainer_peak, 1),
                    "engine_gib": None if e.engine_share is None else round(e.engine_share, 1),
                    "total_gib": round(m.trainer_peak + (e.engine_share or 0.0), 1),
                    "rollout_kv_gib": round(m.rollout_kv, 1), "engine_waves": m.waves(),
                    "step_s": round(e.time.step, 1), "rollout_s": round(e.time.rollout, 1),
                    "update_s": round(e.time.rest, 1), "steps": args.steps,
                    "stage_hours": round(args.steps * e.time.step / 3600, 2),
                }  # fmt: skip
                harness.emit(line | provenance(), args.out)


if __name__ == "__main__":
    main()

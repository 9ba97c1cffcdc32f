"""Rollout speed of the two engines, the own sampler and vLLM, on one model folder. Prints one JSON line.

Each length draws `--prompts` training pairs of that many words per fragment, formats them with the folder's chat
template, and samples `--generations` completions per prompt (temperature 1) within the budget the module would give
them; the random fixture model never stops, so both engines generate the whole budget. One warm-up rollout per engine
and length, then the median of `--repeats`. `tokens_per_s` counts generated tokens (through the stop token) per
second of wall time, `ms_per_token` is its inverse, and `ms_per_step` the time per decoding step of the whole batch.
Without `--model` it builds the Llama-3 test fixture (2 layers, 128 wide, tests/families.py) in a temporary folder.
vLLM's CPU build needs it installed (the README's test command's install steps, on x86-64 Linux).

    python benchmarks/rollout.py [--model FOLDER] [--words 10 50 200] [--prompts 2] [--generations 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import harness
from provenance import provenance


def prompts(tokenizer, words: int, n: int):
    """`n` left-padded training prompts of `words`-word fragments, and the token budget their targets need."""
    from interleave_data.corpus import load_corpus
    from interleave_data.pairs import build_examples
    from interleave_data.prompts import format_prompt
    from interleave_model.generation.rollout import token_budget

    examples = build_examples(load_corpus(None).texts, words, n, seed=0, split="train")
    enc = tokenizer([format_prompt(e.a, e.b, "two_processes", tokenizer) for e in examples], return_tensors="pt",
                    padding=True, add_special_tokens=False)  # fmt: skip
    targets = tokenizer([e.target for e in examples], add_special_tokens=False)["input_ids"]
    return enc.input_ids, enc.attention_mask, token_budget([len(t) for t in targets])


def timed(sample, repeats: int, **kwargs) -> dict[str, float]:
    """Median wall time of `repeats` calls of `sample(generator=..., **kwargs)` after one warm-up, as tokens per
    second and milliseconds."""
    import torch

    sample(**kwargs)
    runs = []
    for seed in range(repeats):
        started = time.perf_counter()
        roll = sample(generator=torch.Generator().manual_seed(seed), **kwargs)
        runs.append((time.perf_counter() - started, int(roll.completion_mask.sum()), roll.completion_ids.shape[1]))
    seconds, tokens, steps = (statistics.median(values) for values in zip(*runs, strict=True))
    return {"tokens_per_s": round(tokens / seconds, 1), "ms_per_token": round(1000 * seconds / tokens, 3),
            "ms_per_step": round(1000 * seconds / steps, 2), "tokens": tokens}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder; default: the Llama-3 test fixture")
    parser.add_argument("--words", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    from interleave_model.generation.rollout import rollout
    from interleave_model.generation.vllm_engine import VllmEngine, VllmSettings
    from interleave_model.model.policy import load_pretrained, stop_token_ids

    torch.set_num_threads(1)  # vLLM's CPU build serves on one thread here too
    workdir = tempfile.TemporaryDirectory()
    folder = args.model if args.model is not None else harness.family_folder("llama3", Path(workdir.name) / "llama3")
    model, tokenizer = load_pretrained(folder, dtype="float32")
    stops = stop_token_ids(model, tokenizer)
    settings = VllmSettings(kv_cache_memory_bytes=256 << 20, max_model_len=2048)
    engine = VllmEngine(model, tokenizer, folder, stops, settings)
    engine.serve(model, version=0)

    def own(prompt_ids, prompt_mask, **kwargs):
        return rollout(model, tokenizer, prompt_ids, prompt_mask, stops, **kwargs)

    lengths = {}
    for words in args.words:
        ids, mask, budget = prompts(tokenizer, words, args.prompts)
        kwargs = {"prompt_ids": ids, "prompt_mask": mask, "num_generations": args.generations,
                  "max_new_tokens": budget, "temperature": 1.0}  # fmt: skip
        lengths[words] = {"prompt_tokens": ids.shape[1], "budget": budget, "own": timed(own, args.repeats, **kwargs),
                          "vllm": timed(engine.rollout, args.repeats, **kwargs)}  # fmt: skip
    engine.close()
    result = {"benchmark": "rollout", "model": "llama3 fixture" if args.model is None else folder,
              "device": "cpu", **provenance(), "prompts": args.prompts,
              "generations": args.generations, "lengths": lengths}  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""What speculative sampling gives the own sampler: drafted tokens kept, tokens per forward, and the rollout's time
with and without it, on the same prompts with the same seed. Prints one JSON line.

A model is a run's checkpoint (`--ckpt`: its model, template and tokenizer) or a model folder / shipped name (`--model`,
with `--template`). Each length draws `--prompts` held-out pairs (validation split, seed 0) and samples
`--generations` answers each, at the training temperature, within the training budget; the rollout runs
`--repeats` times each way and the medians are reported, in wall and CPU seconds (trust the CPU seconds on a shared
machine with `--threads 1`). Greedy answers with speculation are checked equal to those without. `--draft-source
prompt` drafts from the prompt's tokens instead of the target's (vLLM's `ngram` method reads the prompt), to compare.
`--draft-source greedy` (with `--temperature 0`) drafts each prompt's own greedy answer, which the model keeps whole:
the most speculation with `--draft-tokens` can give this model at this batch on this machine, a policy that answers
exactly what its drafts hold. `--merged-copy DTYPE` samples from the adapter-merged copy in that dtype, as training
rollouts do with `model.sampling.merged_copy`.

`--engine vllm` checks vLLM's own `ngram` speculation instead (drafts from the prompt and the answer so far, k =
`--draft-tokens`, lookups of 1 to `--ngram` tokens), the adapter served as LoRA: greedy answers with it against
without it, and the sampled tokens' log-probs the engine returns against the trainer's scores of the same tokens
(what the importance-sampling correction divides by), with both engines' rollout seconds.

    python benchmarks/speculation.py --ckpt RUN/checkpoints/last.ckpt --words 10 25 --draft-tokens 4
    python benchmarks/speculation.py --model smollm2-135m-instruct --template two_processes --words 10
    python benchmarks/speculation.py --ckpt RUN/checkpoints/last.ckpt --words 10 --engine vllm
    python benchmarks/speculation.py --model smollm2-135m-instruct --template compact --words 10 \
        --draft-source greedy --temperature 0
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace
from functools import partial

import harness
import torch
from provenance import provenance


def load(args):
    """The policy, its tokenizer, stop ids and template."""
    from interleave_model.model.policy import load_pretrained, stop_token_ids
    from interleave_model.model.shipped import resolve_model
    from interleave_model.module import InterleaveGRPO

    if args.ckpt:
        module = InterleaveGRPO.load_from_checkpoint(args.ckpt, map_location="cpu")
        return module.policy, module.tokenizer, module.stop_ids, module.hparams["template"]
    model, tokenizer = load_pretrained(resolve_model(args.model), dtype="float32")
    return model, tokenizer, stop_token_ids(model, tokenizer), args.template


def sampled_from(model, merged_copy: str | None):
    """What the rollouts sample from: the model, or its merged copy in that dtype (as training rollouts do)."""
    from interleave_model.generation.merged_copy import MergedCopy

    return model if merged_copy is None else MergedCopy(model, merged_copy).refresh(version=0)


def batch(tokenizer, template: str, words: int, prompts: int):
    """Held-out prompts of `words`-word fragments, left-padded, and their targets' tokens."""
    from interleave_data.corpus import load_corpus
    from interleave_data.pairs import build_examples, split_texts
    from interleave_data.prompts import adds_special_tokens, format_prompt

    texts = split_texts(load_corpus().texts, (0.8, 0.1, 0.1), 0)["val"]
    examples = build_examples(texts, words, prompts, 0, "val")
    enc = tokenizer([format_prompt(e.a, e.b, template, tokenizer) for e in examples], return_tensors="pt",
                    padding=True, add_special_tokens=adds_special_tokens(tokenizer))  # fmt: skip
    targets = [tokenizer(e.target, add_special_tokens=False)["input_ids"] for e in examples]
    return enc.input_ids, enc.attention_mask, targets


def timed(draw, repeats: int) -> tuple[float, float, tuple]:
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = draw()
        harness.synchronize()  # a GPU's work queued by the rollout is part of its time
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), out


def measure(args, model, tokenizer, stops, template: str, words: int) -> dict:
    from interleave_model.generation.rollout import sample, token_budget
    from interleave_model.generation.sampling_params import SamplingParams, Speculation
    from interleave_model.generation.speculative import speculative_sample

    ids, mask, targets = batch(tokenizer, template, words, args.prompts)
    ids, mask = ids.to(model.device), mask.to(model.device)
    params = SamplingParams(num_generations=args.generations, max_new_tokens=token_budget([max(map(len, targets))]),
                            stop_ids=stops, temperature=args.temperature)  # fmt: skip
    pad = tokenizer.pad_token_id
    if args.draft_source == "prompt":  # each prompt's own tokens, padding left out
        targets = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    elif args.draft_source == "greedy":  # each prompt's greedy answer, through its stop
        greedy = replace(params, num_generations=1, temperature=0.0)
        answers, kept = sample(model, ids, mask, greedy, pad_token_id=pad)[:2]
        targets = [row[m.bool()].tolist() for row, m in zip(answers, kept, strict=True)]
    drafts = replace(params, speculation=Speculation(targets, args.draft_tokens, args.ngram, args.max_rows))
    counts: dict[str, int] = {}

    def plain():
        return sample(model, ids, mask, params, torch.Generator().manual_seed(0), pad_token_id=pad)

    def speculative():
        counts.clear()
        return speculative_sample(model, ids, mask, drafts, torch.Generator().manual_seed(0), pad_token_id=pad,
                                  counts=counts)  # fmt: skip

    plain_wall, plain_cpu, plain_out = timed(plain, args.repeats)
    spec_wall, spec_cpu, spec_out = timed(speculative, args.repeats)
    greedy = [plain_out[0], spec_out[0]]  # greedy already, or drawn again greedy
    if args.temperature != 0:
        greedy = [f(model, ids, mask, replace(p, temperature=0.0), pad_token_id=pad)[0]
                  for f, p in ((sample, params), (speculative_sample, drafts))]  # fmt: skip
    tokens = int(spec_out[1].sum())
    rows = ids.shape[0] * args.generations
    row_forwards = counts["row_forwards"] + rows  # each running row's forwards, the prefill's included
    return {
        "words": words,
        "rows": rows,
        "kept_share": round(counts["kept"] / max(counts["drafted"], 1), 3),
        "tokens_per_forward": round(tokens / row_forwards, 2),  # a running row's tokens per forward it runs in
        "forwards": counts["forwards"] + 1,
        "plain_steps": plain_out[0].shape[1],
        "completion_tokens": [int(plain_out[1].sum()), tokens],
        "rollout_s": [round(plain_wall, 3), round(spec_wall, 3)],
        "rollout_cpu_s": [round(plain_cpu, 3), round(spec_cpu, 3)],
        "speedup_cpu": round(plain_cpu / spec_cpu, 2),
        "speedup_wall": round(plain_wall / spec_wall, 2),
        "greedy_equal": bool(torch.equal(greedy[0], greedy[1])),
    }


def vllm_engine(model, tokenizer, stops, speculative: dict | None):
    """A CPU vLLM engine serving `model` (its adapter as LoRA), with vLLM's `speculative_config` when given (the
    project's engine sets none: the option is passed to `vllm.LLM` here only)."""
    import vllm

    from interleave_model.generation.vllm_engine import VllmEngine, VllmSettings

    make = vllm.LLM
    vllm.LLM = lambda **options: make(**options, **({"speculative_config": speculative} if speculative else {}))
    try:
        settings = VllmSettings(kv_cache_memory_bytes=256 << 20, max_model_len=2048, enforce_eager=True)
        engine = VllmEngine(model, tokenizer, None, settings)
    finally:
        vllm.LLM = make
    engine.serve(model, version=0)
    return engine


def measure_vllm(args, model, tokenizer, stops, template: str, words: int) -> dict:
    """vLLM's `ngram` speculation against vLLM without it: greedy answers, log-probs, rollout seconds."""
    from interleave_model.algorithm.completions import completion_logprobs
    from interleave_model.generation.rollout import token_budget
    from interleave_model.generation.sampling_params import SamplingParams

    ids, mask, targets = batch(tokenizer, template, words, args.prompts)
    params = SamplingParams(num_generations=args.generations, max_new_tokens=token_budget([max(map(len, targets))]),
                            stop_ids=stops, temperature=args.temperature)  # fmt: skip
    ngram = {"method": "ngram", "num_speculative_tokens": args.draft_tokens, "prompt_lookup_min": 1,
             "prompt_lookup_max": args.ngram}  # fmt: skip
    out: dict = {"words": words, "rows": ids.shape[0] * args.generations}
    answers = {}
    for name, speculative in (("plain", None), ("ngram", ngram)):
        engine = vllm_engine(model, tokenizer, stops, speculative)
        try:
            answers[name] = engine.rollout(ids, mask, replace(params, temperature=0.0)).completion_ids
            draw = partial(engine.rollout, ids, mask, params)
            wall, _, sampled = timed(draw, args.repeats)
        finally:
            engine.close()
        out[f"rollout_s_{name}"] = round(wall, 3)
        tokens = torch.cat([sampled.prompt_ids, sampled.completion_ids], dim=1)
        attention = torch.cat([sampled.prompt_mask, sampled.completion_mask], dim=1)
        with torch.no_grad():
            trainer, _ = completion_logprobs(model, tokens, attention, sampled.completion_ids, args.temperature)
        kept = sampled.completion_mask.bool()
        gap = (trainer - sampled.logprobs)[kept]
        out[f"sampled_tokens_{name}"] = int(kept.sum())
        out[f"logprob_nan_{name}"] = int(gap.isnan().sum())
        out[f"logprob_off_{name}"] = int((gap.abs() > 1e-3).sum())  # NaN is not > 1e-3: counted apart
        out[f"logprob_gap_max_{name}"] = round(float(gap.nan_to_num(0.0).abs().max()), 6)
        off = (gap.abs() > 1e-3) | gap.isnan()
        out[f"logprob_off_values_{name}"] = [round(v, 4) for v in sampled.logprobs[kept][off][:8].tolist()]
    out["greedy_equal"] = bool(torch.equal(answers["plain"], answers["ngram"]))
    out["uniform_logprob"] = round(-math.log(model.get_output_embeddings().weight.shape[0]), 4)  # over the vocabulary
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", help="a run's checkpoint")
    parser.add_argument("--model", help="a model folder or shipped name, instead of --ckpt")
    parser.add_argument("--template", default="two_processes", help="with --model")
    parser.add_argument("--words", type=int, nargs="+", default=[10, 25])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--max-rows", type=int, default=None, help="draft only in steps of at most this many rows")
    parser.add_argument("--draft-source", choices=["target", "prompt", "greedy"], default="target",
                        help="greedy: each prompt's own greedy answer, all kept (with --temperature 0)")  # fmt: skip
    parser.add_argument("--engine", choices=["own", "vllm"], default="own", help="vllm: its ngram method, checked")
    parser.add_argument("--merged-copy", choices=["float32", "bfloat16"], default=None,
                        help="sample from the merged copy in this dtype, as training rollouts do")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="", help="what the model is (e.g. 'warm start'), carried in the line")
    parser.add_argument("--out", help="also append the JSON line to this file")
    args = parser.parse_args()
    if (args.ckpt is None) == (args.model is None):
        parser.error("give --ckpt or --model")
    if args.draft_source == "greedy" and (args.temperature != 0 or args.engine != "own"):
        parser.error("--draft-source greedy drafts greedy answers: give --temperature 0, with the own engine")
    if args.engine == "vllm" and args.merged_copy:
        parser.error("--merged-copy is the own sampler's: vLLM serves the adapter as LoRA")
    torch.set_num_threads(args.threads)
    trace = provenance(args.threads)
    model, tokenizer, stops, template = load(args)
    model = sampled_from(model, args.merged_copy)
    run = measure_vllm if args.engine == "vllm" else measure
    lengths = [run(args, model, tokenizer, stops, template, words) for words in args.words]
    line = {"benchmark": "speculation", "model": args.ckpt or args.model, "label": args.label, "template": template,
            "draft_tokens": args.draft_tokens, "ngram": args.ngram, "max_rows": args.max_rows, "engine": args.engine,
            "merged_copy": args.merged_copy,
            "draft_source": "prompt and answer" if args.engine == "vllm" else args.draft_source,
            "temperature": args.temperature,
            "lengths": lengths, **trace}  # fmt: skip
    harness.emit(line, args.out)


if __name__ == "__main__":
    main()

"""Held-out greedy answers of the embedded tiny model: generated tokens a second at each length, against the floor of
the model's arithmetic. Prints one JSON line.

The module is built as `--config` builds it (configs/curriculum.yaml: the tiny Llama of 4 layers, width 128, coupled
positions; untrained, so every answer runs to its length's budget, the longest a check can take), and `--pairs`
validation pairs of each of `--lengths` are answered as a held-out check answers them: in the config's
`data.eval_batch_size` batches, greedy, one answer a prompt, through `Sampler.rollout` (not training: the held-out
budget `answer_budget`, the policy itself). One batch of the first length is answered first, untimed.

Per length: `generated_tokens` (through the stop token), `decode_steps` (the batches' widths, summed),
`mean_context` (the positions a generated token's attention reads, on average), `seconds` and `cpu_seconds` of the
rollouts and `tokens_per_s` / `tokens_per_cpu_s`; with `--threads 1` trust the CPU figures on a shared machine (they
are the work's own time). The floor: the model's FLOPs per generated token, each part over torch's measured rate of
that part's shape at `--threads` (timed in CPU time with one thread, as `floor.py` times it):

- decoder linear layers, 2 x their weights, at `[rows, hidden] @ [hidden, intermediate]`;
- the output layer, 2 x its weights, at `[rows, hidden] @ [hidden, vocab]`;
- attention over the cache, 4 x hidden x layers x the token's context, at the batched one-query product
  `[rows * heads, 1, head_dim] @ [rows * heads, head_dim, mean_context]`, cycling through 2 x layers such caches
  as a step reads every layer's keys and values (at long contexts this rate is the memory's).

`rows` is the eval batch size. The prompts' prefill is counted too (2 x the linear weights a prompt token, attention
over half the prompt on average), at `[rows * prompt_tokens, hidden] @ [hidden, intermediate]`. `floor_s` is the
length's floor, `floor_tokens_per_s` its generated tokens over it, `floor_share` the floor over the measured CPU
seconds (1.0 = the arithmetic alone).

    python benchmarks/held_out_speed.py [--config configs/curriculum.yaml] [--lengths 25 100 500] [--pairs 64]
                                        [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import harness
from provenance import provenance


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(harness.ROOT / "configs" / "curriculum.yaml"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[25, 100, 500], help="words per fragment")
    parser.add_argument("--pairs", type=int, default=None, help="pairs per length; default: the config's val_pairs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also append the line to this file")
    return parser.parse_args(argv)


def build(config: dict, lengths: list[int], pairs: int, cache_dir: str):
    """The module as the config's `model` sets it (in eval mode, as a check runs it) and a datamodule holding `pairs`
    validation pairs of each length."""
    from gpu_step import module_from

    from interleave_data.datamodule import InterleaveDataModule

    data = config["data"]
    module = module_from(config["model"], template=data["template"]).eval()
    datamodule = InterleaveDataModule(stages=lengths, train_pairs=1, val_pairs=pairs, test_pairs=0,
                                      template=data["template"], eval_batch_size=data.get("eval_batch_size", 16),
                                      seed=config.get("seed_everything") or 0, cache_dir=cache_dir,
                                      tokenizer=module.tokenizer)  # fmt: skip
    datamodule.prepare_data()
    datamodule.setup("validate")
    return module, datamodule


def batches(datamodule, n_words: int) -> list[dict]:
    """The length's validation pairs collated as a check's batches."""
    examples, size = datamodule.examples(n_words, "val"), datamodule.eval_batch_size
    return [datamodule.collate(examples[i : i + size], phase="eval") for i in range(0, len(examples), size)]


def answer(module, batch: dict):
    """Greedy held-out answers to one batch, as validation draws them (`InterleaveGRPO._rollout` in eval mode)."""
    return module.sampler.rollout(batch, 1, 0.0, None, module.global_step, training=False)


def context_positions(prompt_width: int, completion_mask) -> int:
    """Positions the generated tokens' attention reads, summed: token i of a row (from 0) reads the prompt's
    `prompt_width` columns and the i + 1 tokens before it, its own input included. `completion_mask` [N, C]."""
    lengths = completion_mask.sum(-1)  # [N] generated tokens a row
    return int((lengths * prompt_width + lengths * (lengths + 1) // 2).sum())


def time_length(module, datamodule, n_words: int) -> dict:
    """Answer every batch of a length; its token counts and wall / CPU seconds."""
    tokens = steps = context = prompt = prefilled = at_budget = 0
    wall = cpu = 0.0
    for batch in batches(datamodule, n_words):
        start, start_cpu = time.perf_counter(), time.process_time()
        roll = answer(module, batch)
        wall, cpu = wall + time.perf_counter() - start, cpu + time.process_time() - start_cpu
        width = batch["prompt_ids"].shape[1]
        tokens += int(roll.completion_mask.sum())
        steps += roll.completion_ids.shape[1]
        context += context_positions(width, roll.completion_mask)
        prompt, at_budget = max(prompt, width), at_budget + int(roll.truncated.sum())
        prefilled += int(batch["prompt_mask"].sum())
    return {"n_words": n_words, "pairs": len(datamodule.examples(n_words, "val")), "prompt_tokens": prompt,
            "prefill_tokens": prefilled, "budget": module.sampler.eval_budget(batch), "generated_tokens": tokens,
            "decode_steps": steps, "answers_at_budget": at_budget, "mean_context": round(context / max(tokens, 1), 1),
            "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3),
            "tokens_per_s": round(tokens / wall, 1), "tokens_per_cpu_s": round(tokens / cpu, 1)}  # fmt: skip


def token_flops(shape: dict, context: float) -> dict[str, float]:
    """FLOPs of one generated token by part: the decoder's linear layers, the output layer, attention over `context`
    cached positions (queries times keys, then weights times values: 2 x 2 x hidden a position and layer)."""
    return {"linear": 2 * shape["linear_weights"], "head": 2 * shape["head_weights"],
            "attention": 4 * shape["hidden"] * shape["layers"] * context}  # fmt: skip


def floor_of(length: dict, shape: dict, rates: dict[str, float]) -> dict:
    """The length's floor: its generated tokens' FLOPs, each part at its rate (`rates`, FLOP/s), and the prefill's
    (a prompt token through the linear layers and over half the prompt) at the rate `rates["prefill"]`."""
    flops = token_flops(shape, length["mean_context"])
    prefill = token_flops(shape, length["prompt_tokens"] / 2)
    seconds = length["generated_tokens"] * sum(flops[part] / rates[part] for part in flops)
    seconds += length["prefill_tokens"] * (prefill["linear"] + prefill["attention"]) / rates["prefill"]
    return {"mflop_per_token": round(sum(flops.values()) / 1e6, 3),
            "gflops_per_s": {part: round(rate / 1e9, 2) for part, rate in rates.items()},
            "floor_s": round(seconds, 3), "floor_tokens_per_s": round(length["generated_tokens"] / seconds, 1),
            "floor_share": round(seconds / length["cpu_seconds"], 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    import torch
    import yaml
    from floor import matmul_rate, shape_of

    harness.offline()
    args = parse(argv)
    torch.set_num_threads(args.threads)
    trace = provenance(args.threads)  # the commit as the run starts, not as it ends
    config = yaml.safe_load(Path(args.config).read_text())
    pairs = args.pairs or config["data"].get("val_pairs", 32)
    with tempfile.TemporaryDirectory() as cache:
        module, datamodule = build(config, args.lengths, pairs, cache)
        answer(module, batches(datamodule, args.lengths[0])[0])  # warm-up: first calls' one-time costs
        lengths = [time_length(module, datamodule, n) for n in args.lengths]
    shape, rows = shape_of(module.policy), datamodule.eval_batch_size
    heads = module.policy.config.num_attention_heads
    rates = {"linear": matmul_rate(rows, shape["hidden"], shape["intermediate"]),
             "head": matmul_rate(rows, shape["hidden"], shape["head_weights"] // shape["hidden"])}  # fmt: skip
    for length in lengths:
        context = max(1, round(length["mean_context"]))
        # queries x keys over a cache part for each layer's keys and values, as a step reads them: from memory
        attention = matmul_rate(1, shape["hidden"] // heads, context, batch=rows * heads, operands=2 * shape["layers"])
        prefill = matmul_rate(rows * length["prompt_tokens"], shape["hidden"], shape["intermediate"])
        length |= floor_of(length, shape, rates | {"attention": attention, "prefill": prefill})
    record = {
        "benchmark": "held_out_speed",
        "config": Path(args.config).name,
        "model": module.base.name_or_path,
        "shape": shape,
        "positions": module.policy.config.to_dict().get("position_coupling"),
        "eval_batch_size": rows,
        "lengths": lengths,
        **trace,
    }
    harness.emit(record, args.out)
    return record


if __name__ == "__main__":
    main()

"""The own sampler's decode step under LoRA, and what each way of running it costs. Prints one JSON line.

One batch of `--rows` rows (prompts of `--prompt-tokens` tokens, `--rows / --generations` groups) is decoded for
`--new-tokens` steps with `generation.rollout.sample`, no row ever stopping, in each variant:

- `lora`: the peft model as training samples it, under the trainer's autocast (bf16 on a GPU with `--autocast`);
- `lora_no_autocast`: the same without autocast;
- `merged`: the adapter merged into the base weights for the rollout (`merge_adapter`, then `unmerge_adapter`; the
  two are timed in), and `merged_max_logit_diff`, the largest logit difference from `lora` on the prompt's forward;
- `base`: the base model alone (`disable_adapter`), the floor of any way of running the adapter;
- `copy_float32`, `copy_bfloat16`: the sampler's merged copy (`model.sampling.merged_copy`, its `grouped_decode`
  attention), and `copy_kl`, the mean KL divergence (nats per token) of each copy's next-token distribution from the
  model's over the prompt's positions: the policy mismatch its rollout brings;
- `copy_bfloat16_prepacked` (CPU with oneDNN bf16): the bfloat16 copy with every linear layer's weight reordered
  once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's weight prepacking
  uses), and `prepacked_max_logprob_diff`, its largest log-prob difference from the plain bfloat16 copy over the
  prompt's positions;
- `int8` (`--int8`, CPU): a copy with the adapter merged and every decoder linear layer dynamically quantized to int8
  (per-channel weights, `torch.ao.quantization.quantize_dynamic`), and `int8_kl`, the mean KL divergence (nats per
  token) of its next-token distribution from the model's, over the prompt's positions: the policy mismatch such a
  rollout would bring.

The prompts are the corpus's words in a row, cut to `--prompt-tokens`.

`ms_per_step` is a median over `--repeats` rollouts (after one warm-up) divided by the decode steps.
`floor_ms_per_step` is the bytes of the weights read once per step over the nominal bandwidth (GPU) and
`busy_share` the share of a profiled `lora` rollout the device spent in kernels (GPU): well below 1 means the step
waits on the host (Python and kernel launches), not on memory. The random adapter is initialised away from zero
(`init_lora_weights=False`), so merging changes the weights as a trained one would.

    python benchmarks/decode_levers.py [--model FOLDER | --random-init llama-3.2-3b] [--rows 64] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import harness
from provenance import provenance


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a model folder or a shipped model's name; default: the Llama-3 test fixture"
    )
    parser.add_argument("--random-init", default=None, help="a random model of this shape (harness.RANDOM_SHAPES)")
    parser.add_argument("--dtype", default=None, help="weights dtype, e.g. bfloat16; default: the folder's")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--generations", type=int, default=16, help="rows per prompt (the cache is shared per group)")
    parser.add_argument("--prompt-tokens", type=int, default=170)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--autocast", action="store_true", help="the lora variant under bf16 autocast, as training")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--int8", action="store_true", help="time an int8 copy too (CPU) and its KL from the model")
    return parser.parse_args(argv)


def corpus_prompts(tokenizer, groups: int, length: int):
    """`groups` prompts of `length` tokens: the default corpus's words in a row, tokenized, repeated as needed."""
    import torch

    from interleave_data.corpus import load_corpus

    words = " ".join(word for text in load_corpus(None).texts for word in text.words)
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    need = groups * length
    return torch.tensor((ids * (need // len(ids) + 1))[:need]).view(groups, length)


class PrepackedLinear:
    """A bfloat16 linear layer whose weight is reordered once into oneDNN's blocked layout for `rows` rows a call (what
    inductor's CPU weight prepacking does), instead of at every call."""

    def __init__(self, linear, rows: int) -> None:
        import torch

        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x):
        import torch

        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def prepack_linears(model, rows: int) -> None:
    """Every `nn.Linear` of `model` (bfloat16, CPU) made to run as a `PrepackedLinear`, in place."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # it keeps its place (and its hooks); its call is the packed one
            module.forward = PrepackedLinear(module, rows)


def int8_copy(model):
    """The model with its adapter merged and its decoder's linear layers quantized to int8 (CPU), a copy."""
    import copy

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    merged = copy.deepcopy(model).merge_and_unload()
    head = merged.get_output_embeddings()
    layers = {name: per_channel_dynamic_qconfig for name, module in merged.named_modules()
              if isinstance(module, torch.nn.Linear) and module is not head}  # fmt: skip
    return quantize_dynamic(merged, layers, dtype=torch.qint8)


def main(argv: list[str] | None = None) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    from interleave_model.generation.merged_copy import MergedCopy
    from interleave_model.generation.rollout import sample
    from interleave_model.generation.sampling_params import SamplingParams
    from interleave_model.model.policy import load_pretrained
    from interleave_model.model.shipped import resolve_model

    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trace = provenance()  # the commit as the run starts, not as it ends
    with tempfile.TemporaryDirectory() as work:
        folder = args.model
        if args.random_init:
            folder = harness.random_model_folder(args.random_init, work, "compact")
        elif folder is None:
            folder = harness.family_folder("llama3", f"{work}/llama3")
        model, tokenizer = load_pretrained(resolve_model(folder), dtype=args.dtype)
    model = model.to(device)
    config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear",
                        init_lora_weights=False, task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, config).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    groups = max(args.rows // args.generations, 1)
    prompt_ids = corpus_prompts(tokenizer, groups, args.prompt_tokens).to(device)
    prompt_mask = torch.ones_like(prompt_ids)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()

    params = SamplingParams(num_generations=args.generations, max_new_tokens=args.new_tokens, stop_ids=[-1])

    def rollout(model=model) -> None:
        sample(model, prompt_ids, prompt_mask, params, generator, pad_token_id=0)

    def timed(run) -> float:
        run()  # warm-up
        times = []
        for _ in range(args.repeats):
            harness.synchronize()
            start = time.perf_counter()
            run()
            harness.synchronize()
            times.append(time.perf_counter() - start)
        return round(1000 * statistics.median(times) / args.new_tokens, 3)

    def with_autocast() -> None:
        with autocast:
            rollout()

    def merged() -> None:
        model.merge_adapter()
        try:
            rollout()
        finally:
            model.unmerge_adapter()

    def base() -> None:
        with model.disable_adapter():
            rollout()

    with torch.no_grad():
        lora_logits = model(input_ids=prompt_ids, attention_mask=prompt_mask).logits.float()
        model.merge_adapter()
        merged_logits = model(input_ids=prompt_ids, attention_mask=prompt_mask).logits.float()
        model.unmerge_adapter()
    record = {
        "benchmark": "decode_levers",
        "model": args.random_init or args.model or "llama3 test fixture",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "rows": groups * args.generations,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "lora_r": args.lora_r,
        "autocast": args.autocast,
        "ms_per_step": {
            "lora": timed(with_autocast),
            "lora_no_autocast": timed(rollout),
            "merged": timed(merged),
            "base": timed(base),
        },
        "merged_max_logit_diff": round(float((lora_logits - merged_logits).abs().max()), 5),
        "logit_scale": round(float(lora_logits.abs().max()), 3),
    }
    for dtype in ("float32", "bfloat16"):  # the sampler's merged copy (`model.sampling.merged_copy`)
        copy = MergedCopy(model, dtype).refresh(version=0)
        record["ms_per_step"][f"copy_{dtype}"] = timed(lambda copy=copy: rollout(copy))
        with torch.no_grad():
            p = lora_logits.log_softmax(-1)
            q = copy(input_ids=prompt_ids, attention_mask=prompt_mask).logits.float().log_softmax(-1)
        record.setdefault("copy_kl", {})[dtype] = round(float((p.exp() * (p - q)).sum(-1).mean()), 6)
        if dtype == "bfloat16" and device == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            prepack_linears(copy, rows=groups * args.generations)
            record["ms_per_step"]["copy_bfloat16_prepacked"] = timed(lambda copy=copy: rollout(copy))
            with torch.no_grad():
                packed = copy(input_ids=prompt_ids, attention_mask=prompt_mask).logits.float().log_softmax(-1)
            record["prepacked_max_logprob_diff"] = round(float((packed - q).abs().max()), 5)
        del copy
    if args.int8 and device == "cpu":
        quantized = int8_copy(model)
        record["ms_per_step"]["int8"] = timed(lambda: rollout(quantized))
        with torch.no_grad():
            p = lora_logits.log_softmax(-1)
            q = quantized(input_ids=prompt_ids, attention_mask=prompt_mask).logits.float().log_softmax(-1)
        record["int8_kl"] = round(float((p.exp() * (p - q)).sum(-1).mean()), 4)
    if device == "cuda":
        bandwidth = harness.nominal_bandwidth(torch.cuda.get_device_name())
        record["floor_ms_per_step"] = round(1000 * harness.weight_bytes(model) / bandwidth, 3) if bandwidth else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            start = time.perf_counter()
            with_autocast()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        kernel_s = sum(e.self_device_time_total for e in profile.key_averages()) / 1e6
        record["busy_share"] = round(kernel_s / wall, 3)
    record.update(trace)
    harness.emit(record)
    return record


if __name__ == "__main__":
    main()

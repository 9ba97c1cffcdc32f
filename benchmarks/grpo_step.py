"""Speed and memory of one GRPO optimizer step of this project (rollout -> reward -> update). Prints one JSON line.

Runs `InterleaveGRPO` under a Lightning `Trainer` as `cli.py fit` does, without the warm-start, so the completions of
the untrained model run to the token budget: the most tokens a step can generate. Each length gets its own module,
data and warm-up steps. `step_s` is the time from one training step's start to the next's (data, rollout, reward,
update, logging: everything), a median over the measured steps, and `step_cpu_s` the CPU time this process spent in
it; `tokens_per_s` / `tokens_per_cpu_s` count the generated completion tokens (through EOS) per second of each;
`ms_per_token` / `cpu_ms_per_token` are their inverses, the figures that should stay flat as the fragments grow. On a
shared machine trust the CPU figures (with `--threads 1` they are the step's own work; wall time includes waiting for
a core). `peak_rss_mb` is the process's peak resident memory, `start_rss_mb` its resident memory as the first step
starts (imports, model, data) and `working_rss_mb` the difference; the peak only grows, so measure one length per
process when memory is the question (`vs_trl.py` does). `--random-init llama-3.2-3b` builds a random model of that
architecture (for a GPU: add `--accelerator gpu --bf16 --dtype bfloat16 --lora --gradient-checkpointing`).

    python benchmarks/grpo_step.py [--words 10 50 200] [--steps 5] [--warmup 2] [--prompts 4] [--generations 8]
                                   [--lora] [--beta 0.04] [--max-new-tokens N] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import harness
from provenance import provenance


def build(args: argparse.Namespace, words: int, cache_dir: str):
    """The module (tiny Llama or a local model folder) and a one-stage datamodule, as the demo config builds them."""
    from interleave_data.datamodule import InterleaveDataModule
    from interleave_model.generation.vllm_engine import VllmSettings
    from interleave_model.model.policy import LoraSettings
    from interleave_model.module import InterleaveGRPO
    from interleave_model.settings.loss import Kl
    from interleave_model.settings.optimization import Optimization
    from interleave_model.settings.policy import Base
    from interleave_model.settings.sampling import Sampling

    model = InterleaveGRPO(
        base=Base(name_or_path=args.model, dtype=args.dtype, gradient_checkpointing=args.gradient_checkpointing),
        tiny=harness.tiny_shape(args),
        template=args.template,
        lora=LoraSettings(r=args.lora_r) if args.lora else None,
        rollout_engine=args.rollout_engine,
        vllm=VllmSettings(kv_cache_memory_bytes=args.kv_cache_mb and args.kv_cache_mb * 2**20),
        sampling=Sampling(
            num_generations=args.generations,
            max_new_tokens=args.max_new_tokens,
            merged_copy=None if args.merged_copy == "none" else args.merged_copy,
            importance_sampling_cap=None if args.merged_copy == "none" else 2.0,
        ),
        kl=Kl(beta=args.beta),
        optimization=Optimization(learning_rate=1e-4, lr_schedule="constant", micro_batch_size=args.micro_batch_size),
    )
    data = InterleaveDataModule(stages=[words], train_pairs=args.pairs, val_pairs=0, test_pairs=0,
                                template=args.template, batch_size=args.prompts, cache_dir=cache_dir,
                                tokenizer=model.tokenizer)  # fmt: skip
    return model, data


def measure(args: argparse.Namespace, words: int, cache_dir: str) -> dict:
    """Train warmup + steps optimizer steps at one length and summarize the measured ones."""
    import torch

    torch.manual_seed(0)
    model, data = build(args, words, cache_dir)
    # a step starts at its rollout: its batch was drawn and collated just before
    records = harness.time_phases(model, harness.mark)
    precision = "bf16-mixed" if args.bf16 else None
    harness.quiet_trainer(args.accelerator, precision, args.warmup + args.steps).fit(model, datamodule=data)
    report = harness.summarize([*records, harness.mark()], args.warmup, max(r["width"] for r in records))
    report["micro_batch_size"] = model.micro_batch_size  # the rows a forward the update took (auto: what it chose)
    copy = model.sampler.copy  # the merged copy sampled from (auto: its choice), None without one
    report["merged_copy_dtype"] = copy.dtype if copy is not None else None
    if torch.cuda.is_available() and args.accelerator != "cpu":
        report["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        report["peak_gpu_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, nargs="+", default=[10], help="words per fragment, one run each")
    parser.add_argument("--steps", type=int, default=5, help="measured optimizer steps per length")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (r=--lora-r) instead of all weights")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient; 0 skips the reference forward")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the automatic budget, as training")
    parser.add_argument("--micro-batch-size", type=harness.micro_batch, default="auto",
                        help="model.optimization.micro_batch_size: rows per update forward, all, or auto")  # fmt: skip
    parser.add_argument("--rollout-engine", default="own", choices=["own", "vllm"], help="model.rollout_engine")
    parser.add_argument("--merged-copy", choices=["auto", "float32", "bfloat16", "prepacked", "none"], default="auto",
                        help="model.sampling.merged_copy; none: sample from the policy")  # fmt: skip
    parser.add_argument("--kv-cache-mb", type=int, default=None, help="vLLM's KV cache (MiB); default: its share")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="precision bf16-mixed (GPU, or CPU with bf16)")
    parser.add_argument("--accelerator", default="cpu", help='"cpu" or "gpu"')
    parser.add_argument("--template", default="compact", help="prompt template (compact, as in the CPU demo)")
    parser.add_argument("--pairs", type=int, default=64, help="training pairs built per length")
    parser.add_argument("--model", default="tiny", help='"tiny" (the shape below) or a local HF model folder')
    shapes = sorted(harness.RANDOM_SHAPES)
    parser.add_argument("--random-init", choices=shapes, help="a random model of this architecture")
    parser.add_argument("--dtype", default=None, help="weights dtype when loading --model from a folder")
    harness.add_tiny_shape(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default torch's choice")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    import torch

    harness.offline()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_init:
            args.model = harness.random_model_folder(args.random_init, os.path.join(tmp, "model"), args.template)
        results = {str(words): measure(args, words, os.path.join(tmp, "cache")) for words in args.words}
    first, last = results[str(args.words[0])], results[str(args.words[-1])]
    shape = harness.tiny_name(args)
    if args.random_init:
        shape = f"{args.random_init} (random init)"
    elif args.model != "tiny":
        shape = args.model
    report = {
        "benchmark": "grpo_step",
        **provenance(),
        "cpus": os.cpu_count(),
        "model": shape,
        "precision": "bf16-mixed" if args.bf16 else "32-true",
        "gradient_checkpointing": args.gradient_checkpointing,
        "prompts": args.prompts,
        "generations": args.generations,
        "lora": args.lora,
        "merged_copy": args.merged_copy,
        "micro_batch_size": args.micro_batch_size,
        "beta": args.beta,
        "steps": args.steps,
        "warmup": args.warmup,
        "words": results,
        "ms_per_token_last_over_first": round(last["ms_per_token"] / first["ms_per_token"], 3),
        "cpu_ms_per_token_last_over_first": round(last["cpu_ms_per_token"] / first["cpu_ms_per_token"], 3),
    }
    harness.emit(report)
    return report


if __name__ == "__main__":
    main()

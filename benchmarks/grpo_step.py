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
import json
import os
import resource
import statistics
import sys
import tempfile
import time

from provenance import provenance

# Everything heavy (torch, lightning, transformers) is imported inside the functions, so that `vs_trl.py` can share
# the reporting helpers below without charging TRL's process with this project's imports.


def rss_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak so far, MiB.

    On Linux these are `VmRSS` and `VmHWM`, the high-water mark of this process's own address space. `ru_maxrss` is
    not used there: a process started with `subprocess` inherits its launcher's peak in it, which would charge a
    benchmark with the memory of whatever started it.
    """
    fields = {}
    try:
        with open("/proc/self/status") as status:
            fields = {
                k: int(v.split()[0]) / 2**10
                for k, v in (line.split(":", 1) for line in status)
                if k in ("VmRSS", "VmHWM")
            }
    except OSError:
        pass
    if len(fields) == 2:
        return round(fields["VmRSS"], 1), round(fields["VmHWM"], 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    return round(peak, 1), round(peak, 1)


def budget(words: int) -> int:
    """The token budget of a `words`-word stage with a word-level tokenizer (a 2 * words target), as the module sizes
    it: `vs_trl.py` gives TRL the same."""
    from interleave_model.generation.rollout import token_budget

    return token_budget([2 * words])


def summarize(records: list[dict[str, float]], warmup: int, max_new_tokens: int | None) -> dict:
    """Medians over the measured steps of per-step records.

    Each record holds the step's `start` (wall clock) and `cpu` (this process's CPU time) at its start, the
    `generated_tokens` and the `rollout_s` of its rollout, and maybe `reward_s` and `update_s`; the last record is the
    end mark (only `start` and `cpu`). A step runs from its start to the next one's. CPU seconds are reported beside
    wall seconds because they hardly move when other work shares the machine (with one torch thread, CPU time is the
    step's own work).
    """
    pairs = zip(records[warmup:-1], records[warmup + 1 :], strict=True)
    steps = [r | {"step_s": n["start"] - r["start"], "step_cpu_s": n["cpu"] - r["cpu"]} for r, n in pairs]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in steps)

    report = {
        "step_s": round(median("step_s"), 4),
        "step_s_range": [round(min(r["step_s"] for r in steps), 4), round(max(r["step_s"] for r in steps), 4)],
        "step_cpu_s": round(median("step_cpu_s"), 4),
    }
    report |= {key: round(median(key), 4) for key in ("rollout_s", "reward_s", "update_s") if key in steps[0]}
    tokens_per_s = statistics.median(r["generated_tokens"] / r["step_s"] for r in steps)
    tokens_per_cpu_s = statistics.median(r["generated_tokens"] / r["step_cpu_s"] for r in steps)
    peak_rss_mb = rss_mb()[1]
    return report | {
        "generated_tokens": round(median("generated_tokens")),
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_cpu_s": round(tokens_per_cpu_s, 1),
        "rollout_tokens_per_s": round(statistics.median(r["generated_tokens"] / r["rollout_s"] for r in steps), 1),
        "ms_per_token": round(1e3 / tokens_per_s, 4),
        "cpu_ms_per_token": round(1e3 / tokens_per_cpu_s, 4),
        "max_new_tokens": max_new_tokens,
        "peak_rss_mb": peak_rss_mb,
        "start_rss_mb": records[0]["rss"],
        "working_rss_mb": round(peak_rss_mb - records[0]["rss"], 1),
    }


def time_phases(module, start=dict) -> list[dict[str, float]]:
    """Wrap `module`'s rollout and update so that each GRPO step appends one record: `start()` as its rollout begins,
    then the rollout, reward and update seconds the module measured (all `num_iterations` updates), its mean reward,
    its completion tokens (through EOS) and the rollout's width (decoding steps)."""
    records: list[dict[str, float]] = []
    generate_trajectory, grpo_step = module.generate_trajectory, module.grpo_step

    def timed_generate(batch):
        records.append(start())
        trajectory, stats = generate_trajectory(batch)
        records[-1] |= {"rollout_s": stats["time/rollout_s"], "reward_s": stats["time/reward_s"],
                        "reward_mean": stats["train/reward_mean"],
                        "generated_tokens": float(trajectory.completion_mask.sum()),
                        "width": trajectory.completion_ids.shape[1]}  # fmt: skip
        return trajectory, stats

    def timed_update(trajectory, batch):
        stats = grpo_step(trajectory, batch)
        records[-1]["update_s"] = records[-1].get("update_s", 0.0) + stats["time/update_s"]
        return stats

    module.generate_trajectory, module.grpo_step = timed_generate, timed_update
    return records


def quiet_trainer(accelerator: str, precision: str | None, max_steps: int, validate: bool = False):
    """A one-device Trainer that writes nothing: training steps only, or validation only (`validate`)."""
    import lightning as L

    return L.Trainer(
        accelerator=accelerator, devices=1, precision=precision, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=1.0 if validate else 0,
    )  # fmt: skip


def weight_bytes(model) -> int:
    """Bytes of a model's parameters: what a decode step reads once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def mark() -> dict[str, float]:
    """A step's start: wall clock, CPU time and resident memory."""
    return {"start": time.perf_counter(), "cpu": time.process_time(), "rss": rss_mb()[0]}


# Shapes `--random-init` builds with random weights (a GPU run of the target architecture needs no download).
RANDOM_SHAPES = {
    "llama-3.2-3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": True,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
}  # fmt: skip


def random_model_folder(name: str, folder: str, template: str) -> str:
    """Save a randomly initialised model of shape `name` (bf16) with a word-level tokenizer of its vocabulary size.

    The tokenizer holds the corpus words, so prompts tokenize as in the tiny setting, padded with filler words up to
    the architecture's vocabulary, so every id the model samples decodes.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from interleave_data.corpus import load_corpus
    from interleave_data.prompts import format_prompt
    from interleave_model.model.policy import build_tiny_tokenizer

    shape = RANDOM_SHAPES[name]
    words = [t.words for t in load_corpus(None).texts]
    base = build_tiny_tokenizer(words, extra_words=format_prompt("", "", template).split())
    fillers = [f"<filler{i}>" for i in range(shape["vocab_size"] - len(base))]
    tokenizer = build_tiny_tokenizer(words, extra_words=format_prompt("", "", template).split() + fillers)
    assert len(tokenizer) == shape["vocab_size"]
    config = LlamaConfig(**shape, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build(args: argparse.Namespace, words: int, cache_dir: str):
    """The module (tiny Llama or a local model folder) and a one-stage datamodule, as the demo config builds them."""
    from interleave_data.datamodule import InterleaveDataModule
    from interleave_model.generation.vllm_engine import VllmSettings
    from interleave_model.model.policy import LoraSettings, TinyModelConfig
    from interleave_model.module import InterleaveGRPO
    from interleave_model.settings import Base, Loss, Optimization, Sampling

    shape = TinyModelConfig(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                            intermediate_size=args.mlp)  # fmt: skip
    model = InterleaveGRPO(
        base=Base(name_or_path=args.model, dtype=args.dtype, gradient_checkpointing=args.gradient_checkpointing),
        tiny=shape,
        template=args.template,
        lora=LoraSettings(r=args.lora_r) if args.lora else None,
        rollout_engine=args.rollout_engine,
        vllm=VllmSettings(kv_cache_memory_bytes=args.kv_cache_mb and args.kv_cache_mb * 2**20),
        sampling=Sampling(
            num_generations=args.generations, max_new_tokens=args.max_new_tokens, merged_copy=args.merged_copy
        ),
        loss=Loss(beta=args.beta),
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
    records = time_phases(model, mark)  # a step starts at its rollout: its batch was drawn and collated just before
    precision = "bf16-mixed" if args.bf16 else None
    quiet_trainer(args.accelerator, precision, args.warmup + args.steps).fit(model, datamodule=data)
    report = summarize([*records, mark()], args.warmup, max(r["width"] for r in records))
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
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per update forward; default all")
    parser.add_argument("--rollout-engine", default="own", choices=["own", "vllm"], help="model.rollout_engine")
    parser.add_argument("--merged-copy", choices=["float32", "bfloat16"], help="model.sampling.merged_copy")
    parser.add_argument("--kv-cache-mb", type=int, default=None, help="vLLM's KV cache (MiB); default: its share")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="precision bf16-mixed (GPU, or CPU with bf16)")
    parser.add_argument("--accelerator", default="cpu", help='"cpu" or "gpu"')
    parser.add_argument("--template", default="compact", help="prompt template (compact, as in the CPU demo)")
    parser.add_argument("--pairs", type=int, default=64, help="training pairs built per length")
    parser.add_argument("--model", default="tiny", help='"tiny" (the shape below) or a local HF model folder')
    parser.add_argument("--random-init", choices=sorted(RANDOM_SHAPES), help="a random model of this architecture")
    parser.add_argument("--dtype", default=None, help="weights dtype when loading --model from a folder")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default torch's choice")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_init:
            args.model = random_model_folder(args.random_init, os.path.join(tmp, "model"), args.template)
        results = {str(words): measure(args, words, os.path.join(tmp, "cache")) for words in args.words}
    first, last = results[str(args.words[0])], results[str(args.words[-1])]
    shape = f"tiny llama h{args.hidden_size} l{args.layers} a{args.heads} mlp{args.mlp}"
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
        "beta": args.beta,
        "steps": args.steps,
        "warmup": args.warmup,
        "words": results,
        "ms_per_token_last_over_first": round(last["ms_per_token"] / first["ms_per_token"], 3),
        "cpu_ms_per_token_last_over_first": round(last["cpu_ms_per_token"] / first["cpu_ms_per_token"], 3),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

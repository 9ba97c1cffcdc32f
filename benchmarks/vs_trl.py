"""This project's GRPO step against TRL's GRPOTrainer on the same work, alternating in one run. Prints one JSON line.

Same model (the embedded tiny Llama, built once and saved to a temporary folder that both load offline, all weights
trained), same data (the training pairs of each length in the same prompt template), same group (4 prompts x 8
completions), same token budget, same loss settings (beta 0.04, epsilon 0.2, "grpo" loss, group-scaled rewards, one
update per rollout, lr 1e-4 constant, clip norm 1.0, fp32 (`--bf16`: bf16 autocast in both), no gradient
checkpointing, temperature 1). Every measurement runs in a process of its own, so one framework's imports and
allocations never count against the other, and the order of the two alternates from round to round. Figures are
medians over rounds; `ratios` are ours / TRL's (tokens per second: higher is better; peak and working RSS: lower is
better). The machine's other load shows in `spread`; on a shared machine pass `--threads 1` and read
`tokens_per_cpu_s`, which waiting for a core does not move.

    pip install -e ".[bench]"
    python benchmarks/vs_trl.py [--words 10 50] [--rounds 2] [--steps 4] [--warmup 1] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from provenance import provenance

HERE = Path(__file__).resolve().parent
ENV = harness.OFFLINE | {"TRANSFORMERS_OFFLINE": "1"}


def prepare(workdir: Path, args: argparse.Namespace) -> Path:
    """The model folder both load (the tiny model saved under `workdir`, or `--base` resolved to its folder), and
    every length's training prompts as JSONL under `workdir`, in the chat template when the tokenizer has one."""
    from transformers import AutoTokenizer

    from interleave_data.datamodule import InterleaveDataModule
    from interleave_data.prompts import format_prompt
    from interleave_model.model.shipped import resolve_model
    from interleave_model.module import InterleaveGRPO

    if args.base == "tiny":
        module = InterleaveGRPO(tiny=harness.tiny_shape(args), template=args.template)
        folder, tokenizer = workdir / "model", module.tokenizer
        module.policy.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        folder = Path(resolve_model(args.base))
        tokenizer = AutoTokenizer.from_pretrained(folder)  # its chat template, for the prompts: not the weights
    for words in args.words:
        data = InterleaveDataModule(stages=[words], train_pairs=args.pairs, val_pairs=0, test_pairs=0,
                                    template=args.template, cache_dir=str(workdir / "cache"))  # fmt: skip
        data.prepare_data()
        data.setup("fit")
        with open(workdir / f"prompts_{words}.jsonl", "w") as out:
            for example in data.examples(words, "train"):
                prompt = format_prompt(example.a, example.b, args.template, tokenizer)
                out.write(json.dumps({"prompt": prompt, "target": example.target}) + "\n")
    return folder


def command(framework: str, args: argparse.Namespace, workdir: Path, folder: Path, words: int) -> list[str]:
    """The command line of one measurement: `grpo_step.py` for ours, this script's worker mode for TRL."""
    settings = {"words": words, "steps": args.steps, "warmup": args.warmup, "beta": args.beta, "prompts": args.prompts,
                "generations": args.generations, "model": folder, "threads": args.threads,
                "max-new-tokens": tokens(args, words), "lora-r": args.lora_r or None}  # fmt: skip
    shared = [item for key, value in settings.items() if value is not None for item in (f"--{key}", str(value))]
    shared += ["--bf16"] if args.bf16 else []
    if framework == "ours":
        extra = ["--template", args.template, "--pairs", str(args.pairs), "--dtype", "float32"]
        extra += ["--lora"] if args.lora_r else []
        extra += ["--rollout-engine", args.rollout_engine]
        if args.rollout_engine == "vllm":
            extra += ["--kv-cache-mb", str(args.kv_cache_mb)]
        extra += ["--micro-batch-size", str(args.micro_batch_size or "all"), "--merged-copy", args.merged_copy]
        return [sys.executable, str(HERE / "grpo_step.py"), *shared, *extra]
    return [sys.executable, str(HERE / "vs_trl.py"), "--trl-worker", str(workdir / f"prompts_{words}.jsonl"), *shared]


def tokens(args: argparse.Namespace, words: int) -> int:
    """The completion budget both get: `--max-new-tokens`, else a word-level tokenizer's for `words` (`budget`)."""
    return args.max_new_tokens or harness.budget(words)


def run(command_line: list[str]) -> dict:
    """Run one measurement in a fresh process; return the JSON line it printed last."""
    done = subprocess.run(command_line, capture_output=True, text=True, env=os.environ | ENV, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(command_line)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def trl_worker(args: argparse.Namespace) -> dict:
    """Train warmup + steps optimizer steps with TRL's GRPOTrainer and summarize them as `grpo_step.py` does."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from interleave_model.evaluation.alignment import score_batch

    if args.threads:
        torch.set_num_threads(args.threads)
    words = args.words[0]
    group = args.prompts * args.generations
    records: list[dict[str, float]] = []

    def alignment(completions: list[str], target: list[str], **kwargs) -> list[float]:
        return score_batch([" ".join(c.split()) for c in completions], target)

    class StepTimer(TrainerCallback):
        """Step starts (a step runs from one start to the next) and the generated tokens TRL logs for each step."""

        def on_step_begin(self, *unused, **kwargs) -> None:
            records.append(harness.mark())

        def on_log(self, _args, _state, _control, logs=None, **kwargs) -> None:
            if logs and "completions/mean_length" in logs:
                records[-1]["generated_tokens"] = logs["completions/mean_length"] * group

    rows = [json.loads(line) for line in open(args.trl_worker)]
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    peft_config = None
    if args.lora_r:  # this project's LoRA: every linear layer, alpha 2r, no dropout
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=group,
            num_generations=args.generations,
            max_completion_length=tokens(args, words),
            max_steps=args.warmup + args.steps,
            learning_rate=1e-4,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=args.beta,
            epsilon=0.2,
            loss_type="grpo",
            scale_rewards="group",
            num_iterations=1,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            gradient_checkpointing=False,  # TRL's default is on; this project's is off
            bf16=args.bf16,  # TRL's default is on; fp32 for both unless --bf16 (bf16 autocast for both)
            use_cpu=True,
            seed=0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_pin_memory=False,
        )
        trainer = GRPOTrainer(model=args.model, reward_funcs=alignment, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(rows), callbacks=[StepTimer()],
                              peft_config=peft_config)  # fmt: skip
        generate = trainer._generate

        def timed_generate(*a, **kw):  # TRL's rollout: prompts in, decoded completions out
            started = time.perf_counter()
            out = generate(*a, **kw)
            records[-1]["rollout_s"] = time.perf_counter() - started
            return out

        trainer._generate = timed_generate
        trainer.train()
    return harness.summarize([*records, harness.mark()], args.warmup, tokens(args, words))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, nargs="+", default=[10, 50], help="words per fragment")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per framework and length")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads in both; default torch's")
    parser.add_argument("--template", default="compact")
    parser.add_argument("--base", default="tiny", help='"tiny" (the shape below), a shipped model\'s name or a folder')
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank in both (all linear layers); 0: all weights")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion budget; default: budget(words)")
    parser.add_argument("--pairs", type=int, default=64, help="training pairs per length")
    parser.add_argument("--merged-copy", default="auto", choices=["auto", "float32", "bfloat16", "none"],
                        help="ours: model.sampling.merged_copy (grpo_step.py's default: auto)")  # fmt: skip
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 autocast in both: ours precision bf16-mixed, TRL's bf16=True")  # fmt: skip
    parser.add_argument("--rollout-engine", default="own", choices=["own", "vllm"], help="ours: model.rollout_engine")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="ours with vLLM: its KV cache, MiB")
    parser.add_argument("--micro-batch-size", type=harness.micro_batch, default="auto",
                        help="ours: rows per update forward, all, or auto (grpo_step.py's default)")  # fmt: skip
    harness.add_tiny_shape(parser)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # worker mode: the saved model folder
    parser.add_argument("--trl-worker", metavar="PROMPTS_JSONL", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def compare(runs: dict[str, list[dict]]) -> dict:
    """Medians of both frameworks' runs at one length, their spread over rounds, and ours / TRL's ratios."""
    keys = ("step_s", "step_cpu_s", "rollout_s", "tokens_per_s", "tokens_per_cpu_s", "rollout_tokens_per_s",
            "ms_per_token", "peak_rss_mb", "start_rss_mb", "working_rss_mb")  # fmt: skip
    medians = {fw: {k: round(statistics.median(r[k] for r in rs), 4) for k in keys} for fw, rs in runs.items()}
    spread = {
        fw: {
            k: [min(r[k] for r in rs), max(r[k] for r in rs)]
            for k in ("tokens_per_s", "tokens_per_cpu_s", "peak_rss_mb")
        }
        for fw, rs in runs.items()
    }
    # the rows a forward each of our rounds took (`auto`: what it measured as the fastest there)
    medians["ours"]["micro_batch_sizes"] = [r.get("micro_batch_size") for r in runs["ours"]]
    medians["ours"]["merged_copy_dtypes"] = [r.get("merged_copy_dtype") for r in runs["ours"]]
    ours, trl = medians["ours"], medians["trl"]

    def ratio(key: str) -> float:
        return round(ours[key] / trl[key], 2)

    return {
        "ours": ours | {"generated_tokens": runs["ours"][0]["generated_tokens"]},
        "trl": trl | {"generated_tokens": runs["trl"][0]["generated_tokens"]},
        "spread": spread,
        "ratios": {
            "tokens_per_s": ratio("tokens_per_s"),
            "tokens_per_cpu_s": ratio("tokens_per_cpu_s"),
            "rollout_tokens_per_s": ratio("rollout_tokens_per_s"),
            "peak_rss": ratio("peak_rss_mb"),
            "working_rss": ratio("working_rss_mb"),
        },
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.trl_worker:
        print(json.dumps(trl_worker(args)))
        return {}
    import trl

    runs = {words: {"ours": [], "trl": []} for words in args.words}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        folder = prepare(workdir, args)
        for round_index in range(args.rounds):
            order = ("ours", "trl") if round_index % 2 == 0 else ("trl", "ours")
            for words in args.words:
                for framework in order:
                    result = run(command(framework, args, workdir, folder, words))
                    runs[words][framework].append(result["words"][str(words)] if framework == "ours" else result)
    results = {str(words): compare(by_framework) for words, by_framework in runs.items()}
    report = {
        "benchmark": "vs_trl",
        **provenance(args.threads),
        "trl": trl.__version__,
        "cpus": os.cpu_count(),
        "model": harness.tiny_name(args) if args.base == "tiny" else args.base,
        "lora_r": args.lora_r,
        "max_new_tokens": {w: tokens(args, w) for w in args.words},
        "prompts": args.prompts,
        "generations": args.generations,
        "beta": args.beta,
        "precision": "bf16-mixed" if args.bf16 else "32-true",
        "ours": {
            "rollout_engine": args.rollout_engine,
            "micro_batch_size": args.micro_batch_size,
            "merged_copy": args.merged_copy,
        }
        | ({"kv_cache_mb": args.kv_cache_mb} if args.rollout_engine == "vllm" else {}),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "launcher_peak_rss_mb": harness.rss_mb()[1],
        "words": results,
        "targets_met": {
            f"tokens_per_s>=3x_at_{w}": r["ratios"]["tokens_per_s"] >= 3
            for w, r in results.items()
            if w in ("10", "50")
        }
        | {f"peak_rss<=0.5x_at_{w}": r["ratios"]["peak_rss"] <= 0.5 for w, r in results.items()},
    }
    harness.emit(report)
    return report


if __name__ == "__main__":
    main()

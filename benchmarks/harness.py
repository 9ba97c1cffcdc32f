"""What the benchmarks share: the offline environment, resident memory and time marks, the medians of a run's step
records, a quiet Trainer, the --micro-batch-size and tiny-shape arguments, a parameter count in bytes, a GPU's nominal
bandwidth, model folders (random weights of a real shape, the tests' real-family fixtures) and the JSON line printed.

Every benchmark imports it as a module (`import harness`), run from this folder as `python benchmarks/<name>.py`.
Everything heavy (torch, lightning, transformers) is imported inside the functions, so that `vs_trl.py` can share the
reporting helpers without charging TRL's process with this project's imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the checkout this file lives in comes before any installed copy: a benchmark run from another worktree (a detached
# one, while the main checkout is edited) imports that worktree's code, the commit its line names, where an editable
# install would import the installed checkout's
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))
# a benchmark reads nothing from the hub, and a process of its own keeps the Rust tokenizer to one thread
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def offline() -> None:
    """`OFFLINE` in this process's environment, where the environment does not set them already."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)


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


def micro_batch(value: str) -> int | str | None:
    """A `--micro-batch-size` argument: a number of rows, "all" (None: every row at once) or "auto" (the fastest,
    measured: `model.optimization.micro_batch_size: auto`)."""
    return value if value == "auto" else None if value == "all" else int(value)


def add_tiny_shape(parser: argparse.ArgumentParser) -> None:
    """The tiny Llama's shape as arguments: `--hidden-size`, `--layers`, `--heads`, `--mlp`."""
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=256)


def tiny_shape(args: argparse.Namespace):
    """The `TinyModelConfig` of `add_tiny_shape`'s arguments."""
    from interleave_model.model.policy import TinyModelConfig

    return TinyModelConfig(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                           intermediate_size=args.mlp)  # fmt: skip


def tiny_name(args: argparse.Namespace) -> str:
    """How a line names the tiny Llama of `add_tiny_shape`'s arguments."""
    return f"tiny llama h{args.hidden_size} l{args.layers} a{args.heads} mlp{args.mlp}"


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


def synchronize() -> None:
    """Wait for the GPU's queued work (a GPU's time is only measured once its kernels have run); nothing on a CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def nominal_bandwidth(gpu: str | None) -> float | None:
    """The nominal HBM bandwidth (bytes/s) of a GPU by its CUDA name, for the GPUs the benchmarks know; else None."""
    if not gpu:
        return None
    if re.search(r"\bH200\b", gpu):
        return 4.8e12
    if re.search(r"\bH100\b", gpu):
        if "PCIe" in gpu:
            return 2.0e12
        return 3.35e12 if ("SXM" in gpu or "HBM3" in gpu) else None  # "H100 80GB HBM3" is the SXM card
    if re.search(r"\bA100\b", gpu) and "80GB" in gpu:
        return 2.0e12
    return None


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


def family_folder(name: str, folder: str | Path) -> str:
    """One of the tests' real-family model folders (tests/families.py: "llama3", "qwen2" or "gpt2"; byte-level BPE,
    chat template, several stop ids) built into `folder`, for a benchmark run without a model folder. The builder is
    read from its file, so the checkout's `tests` need not be importable."""
    spec = importlib.util.spec_from_file_location("families", ROOT / "tests" / "families.py")
    families = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(families)
    return str(families.build_family(name, Path(folder)))


def emit(line: dict, out: str | None = None) -> None:
    """Print a benchmark's JSON line, and append it to `out` when given."""
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")

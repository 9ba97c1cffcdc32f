"""The settings groups of the model, its sampling, evaluation and engines, with TRL's names where TRL has the knob;
the update's groups (`model.loss`, `model.kl`, `model.guidance`, `model.optimization`) are in `loss_settings.py`, and
`groups.py` lists the groups the module holds. Together they are the one place a reader looks a setting up.

Each group is a dataclass that a config writes under its key of `model`; the code that reads a group imports it from
its file, and this module imports nothing of the project.

```yaml
model:
  base:              {name_or_path: tiny, dtype: null, gradient_checkpointing: false, init_from: null, ...}
  sampling:          {num_generations: 8, temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: null, ...}
  loss:              {epsilon: 0.2, epsilon_high: null, loss_type: grpo, scale_rewards: group, ...}
  kl:                {beta: 0.0, estimator: k3}
  guidance:          {weight: 0.5}                                                                   # null: off
  optimization:      {learning_rate: 1.0e-05, sft_learning_rate: 0.001, warmup_steps: 0, max_grad_norm: 1.0, ...}
  evaluation:        {num_samples: 0, temperature: 1.0, pass_k: null, pass_threshold: 1.0}
  tiny:              {hidden_size: 128, num_layers: 2, num_heads: 4, intermediate_size: 256, ...}
  lora:              {r: 16, alpha: 32, dropout: 0.05, target_modules: all-linear, top_layers: null}   # null: off
  dynamic_sampling:  {max_rounds: 2}                                                                  # null: off
  vllm:              {gpu_memory_utilization: 0.3, max_model_len: null, enforce_eager: false, ...}     # null: off
```

- `Base` (`model.base`): the model trained and how it is loaded; the module hands it to `model/policy.py`.
- `Sampling` (`model.sampling`): how the training rollout samples; read by `generation/sampler.py` and the module.
- In `loss_settings.py`: `Loss` (`model.loss`), GRPO's advantages and clipped policy loss (`algorithm/grpo.py`);
  `Kl` (`model.kl`) and `Guidance` (`model.guidance`), the auxiliary terms of the loss (`algorithm/kl.py`, and
  `algorithm/update.target_backward` weighted by mu); `Optimization` (`model.optimization`), the optimizer and
  `algorithm/schedule.py`'s learning rate.
- `Evaluation` (`model.evaluation`): how validation, test and predict answer; read by `evaluation/evaluator.py`.
- `TinyModelConfig` (`model.tiny`): the embedded tiny model's shape; read by `model/policy.py`.
- `LoraSettings` (`model.lora`): the adapter; read by `model/policy.py`.
- `DynamicSampling` (`model.dynamic_sampling`): DAPO's refill; the module runs `algorithm/dynamic_sampling.py`.
- `VllmSettings` (`model.vllm`): the vLLM engine's options; read by `generation/vllm_engine.py`.

The string choices are `Literal`s (`TinyPositions` here; `KlEstimator`, `LossType`, `ScaleRewards`,
`AdvantageEstimator`, `LrSchedule` in `loss_settings.py`), so a typo fails when the config is parsed. Checkpoints
written before the groups existed hold them flat (`model_name_or_path`, `temperature`, `eval_num_samples`, ...), and
older ones hold the auxiliary terms' settings in `loss` (`beta`, `guidance`, ...); `model/migrations.py` puts them
into today's groups and drops the settings removed since, one line each. Older checkpoints name the pickled classes
by the modules that held them before (`model.policy.LoraSettings`); `model/checkpoint.py` maps those names to these
classes when a checkpoint loads (`migrations.old_paths`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# The string choices, as types: a config naming another value is refused when it is parsed, before any step runs.
TinyPositions = Literal["rope", "coupled", "none"]


class SettingsError(ValueError):
    """A setting out of its range, or settings that do not fit together: the CLI says it in one `error:` line."""


TINY = "tiny"
"""`model.base.name_or_path` of the embedded tiny Llama, built in memory (`model/policy.py`)."""


@dataclass
class Base:
    """The model trained, and how it is loaded and prepared (`model.base`).

    Args:
        name_or_path: A local HF model folder, a shipped model's name ("smollm2-135m-instruct": fetched and built
            into a cached folder on first use, `model/shipped.py`), a hub name (when online), or "tiny" for the
            embedded tiny Llama (`model.tiny`). None: the config names no model and the command asks for one.
        dtype: Weights dtype when loading ("bfloat16", "float32", "auto"); mixed precision is the trainer's.
        attn_implementation: Passed to `from_pretrained` ("sdpa", "eager", "flash_attention_2").
        trust_remote_code: Allow model code from the model folder. Off unless you trust it.
        gradient_checkpointing: Recompute activations in the backward pass (less memory, ~30% more time).
        disable_dropout: Set every dropout of the policy (adapter included) to 0, as TRL does by default: the ratio
            then compares equal forwards, and is exactly 1 at a rollout's first update.
        init_from: Start from the weights of an earlier run: its `.ckpt`, or a stage folder it exported
            (`<run>/stages/<N>words`, a full model or a LoRA adapter). Optimizer and curriculum start afresh.
    """

    name_or_path: str | None = TINY
    dtype: str | None = None
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    disable_dropout: bool = True
    init_from: str | None = None


@dataclass
class Sampling:
    """How the training rollout samples (`model.sampling`).

    Args:
        num_generations: Completions per prompt (G); group-relative advantages need at least 2.
        temperature: Sampling temperature of the rollout (and of the log-probs, as in TRL) at the start of training;
            the one in use is the module's (`InterleaveGRPO.temperature`), which a curriculum may raise.
        top_p: Nucleus sampling mass.
        top_k: Keep the k most likely tokens; 0 keeps all.
        max_new_tokens: Fixed token budget of the training rollout; None sizes it per batch from the targets' token
            lengths. Held-out answers have a budget of their length (`generation.rollout.answer_budget`).
        budget_margin: Share of the longest target's token length added to the automatic budget.
        merged_copy: The own sampler's training rollout comes from a copy of the policy with the adapter merged into
            its weights, in this dtype ("float32" or "bfloat16"), refreshed after each update
            (`generation/merged_copy.py`); null samples from the policy itself. "float32" samples the same
            distribution up to rounding; "bfloat16" reads half the bytes per decode step but samples a slightly
            different policy (its log-probs are recorded: `train/engine_logprob_gap`), and on a CPU without bf16
            instructions falls back to "float32". "prepacked" is the bfloat16 copy with every decoder linear
            layer's weight reordered into oneDNN's blocked layout once per update instead of at every decode step
            (a CPU whose oneDNN has bf16; elsewhere the plain "bfloat16"). "auto" times a short rollout of the first
            training batch from each (five draws after a warm-up, the median) and keeps the fastest
            (`merged_copy.fastest_copy`), said in one line with the times and their spread. Validation, test and
            predict never sample from this copy: a LoRA policy's held-out answers come from a copy merged in the
            policy's own dtype (`Sampler._held_out_model`), whatever this says.
        importance_sampling_cap: With a merged copy, weight each token's policy-gradient term by the truncated
            importance ratio min(pi_policy / pi_copy, cap) (TIS, as `model.vllm.importance_sampling_cap` does for
            vLLM's samples); null: no correction.
        speculative_tokens: The own sampler's speculative sampling (`generation/speculative.py`): k tokens drafted
            per decode step from the batch's targets, kept or not by the exact rule of Leviathan et al. (2023), so
            what is sampled has the model's distribution; 0 decodes one token a step.
        speculative_ngram: The longest suffix of an answer the draft looks up in its target.
        speculative_max_rows: Draft only in decode steps of at most this many rows (the batch shrinks as answers
            stop), as vLLM's `disable_by_batch_size` does; null: in every step. A forward over k + 1 tokens a row
            costs more against one of 1 the more rows it runs (docs/RESULTS.md, "Speculative sampling").
    """

    num_generations: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None
    budget_margin: float = 0.25
    merged_copy: str | None = None
    importance_sampling_cap: float | None = None
    speculative_tokens: int = 0
    speculative_ngram: int = 3
    speculative_max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_tokens < 0 or self.speculative_ngram < 1:
            raise SettingsError(
                "model.sampling.speculative_tokens must be >= 0 and model.sampling.speculative_ngram >= 1, got "
                f"{self.speculative_tokens} and {self.speculative_ngram}"
            )
        if self.speculative_max_rows is not None and self.speculative_max_rows < 1:
            raise SettingsError(
                f"model.sampling.speculative_max_rows must be >= 1 or null, got {self.speculative_max_rows}"
            )
        if self.num_generations < 2:
            raise SettingsError(
                f"model.sampling.num_generations must be >= 2 for group-relative advantages, got {self.num_generations}"
            )
        if self.merged_copy not in (None, "auto", "float32", "bfloat16", "prepacked"):
            raise SettingsError(
                f"model.sampling.merged_copy must be null, auto, float32, bfloat16 or prepacked, got "
                f"{self.merged_copy!r}"
            )
        if self.importance_sampling_cap is not None and self.importance_sampling_cap < 1.0:
            raise SettingsError(
                f"model.sampling.importance_sampling_cap must be null or >= 1, got {self.importance_sampling_cap}"
            )


@dataclass
class Evaluation:
    """How validation, test and predict answer (`model.evaluation`); greedy answers are always scored.

    These describe the evaluation, not the training: `validate --ckpt_path` keeps the command's values, never the
    checkpoint's.

    Args:
        num_samples: Answers sampled per prompt for pass@k and diversity (n); 0 = greedy only. Sampled with
            `temperature` and `sampling.top_p` / `sampling.top_k`, seeded by the seed, the length and the batch.
        temperature: Sampling temperature of those answers.
        pass_k: The k of each pass@k reported, each <= num_samples; None means [1, num_samples].
        pass_threshold: Alignment score a sampled answer needs to count as correct for pass@k; 1.0 = exact match.
        sample_lengths: The lengths whose prompts get sampled answers; None: every length. Sampling costs
            `num_samples` answers a prompt, so pass@k at one frontier length costs a fraction of it at all of them.
    """

    num_samples: int = 0
    temperature: float = 1.0
    pass_k: list[int] | None = None
    pass_threshold: float = 1.0
    sample_lengths: list[int] | None = None

    def __post_init__(self) -> None:
        resolve_pass_k(self.num_samples, self.pass_k)  # a k outside [1, num_samples] is refused when built


def resolve_pass_k(num_samples: int, ks: Sequence[int] | None) -> list[int]:
    """The sorted k values of pass@k for `num_samples` answers per prompt; None means ``[1, num_samples]``.

    Raises:
        ValueError: If `num_samples` is negative or a k is outside ``[1, num_samples]``.
    """
    if num_samples < 0:
        raise SettingsError(f"model.evaluation.num_samples must be >= 0, got {num_samples}")
    if num_samples == 0:
        return []
    ks = sorted(set(ks)) if ks is not None else sorted({1, num_samples})
    if not ks or ks[0] < 1 or ks[-1] > num_samples:
        raise SettingsError(f"model.evaluation.pass_k must be in [1, num_samples={num_samples}], got {ks}")
    return ks


@dataclass
class TinyModelConfig:
    """Shape of the embedded tiny Llama that the demo and the tests train on a CPU (`model.tiny`).

    Args:
        hidden_size: Width of the residual stream.
        num_layers: Number of decoder layers.
        num_heads: Attention heads (and key/value heads).
        intermediate_size: Width of the MLP.
        max_position_embeddings: Longest prompt + answer, in tokens (500-word stages need about 2,100).
        freeze_embeddings: Keep the tied embeddings at their random init. Measured: trainable embeddings never
            learn to copy words unseen in training (held-out plateau 0.83); frozen random ones do (0.97).
        embedding_std: Standard deviation of the (tied) embeddings' random init. As output rows they set how sharp
            the softmax can get: at 0.02 (the Llama default) supervised training plateaued near 0.92 held-out at
            10 words; at 0.1 the same run reached 0.98.
        positions: How the model numbers its tokens. "rope": rotary positions 0, 1, 2, ... (a stock Llama);
            "coupled": rotary positions coupled to the source words (`model.positions`: each answer word at its
            source word's position), which only the own sampler runs; "none": no positional encoding (NoPE, a
            SmolLM3 with rotary off in every layer).
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    freeze_embeddings: bool = True
    embedding_std: float = 0.1
    positions: TinyPositions = "rope"


ALL_LINEAR = "all-linear"
"""peft's shorthand for every linear layer but the output head, whatever the family calls them (Llama's seven
projections, GPT-2's `c_attn`, `c_proj`, `c_fc`)."""


@dataclass
class LoraSettings:
    """LoRA adapter settings (`model.lora`; null trains all weights), passed to `peft.LoraConfig`.

    Args:
        r: Rank of the update.
        alpha: Scaling numerator (`lora_alpha`); the update is scaled by alpha / r.
        dropout: Dropout on the adapter input.
        target_modules: Names of the linear layers that get an adapter, or "all-linear" (the default): every linear
            layer but the output head, under the family's own names.
        top_layers: Adapt only the last this many decoder layers (peft's `layers_to_transform`); None adapts all.
            The backward then stops at the lowest adapted layer: with the top third of the layers, an update costs
            about half of what the whole stack does.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str = ALL_LINEAR
    top_layers: int | None = None

    def __post_init__(self) -> None:
        if self.r < 1:
            raise SettingsError(f"model.lora.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise SettingsError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.top_layers is not None and self.top_layers < 1:
            raise SettingsError(f"model.lora.top_layers must be null or >= 1, got {self.top_layers}")


@dataclass
class DynamicSampling:
    """Settings of dynamic sampling (`model.dynamic_sampling`); null (the default) turns it off.

    A group whose G rewards are all equal has zero advantage: it adds no policy gradient, only KL and a share of the
    normaliser. Such groups are dropped and replaced by groups rolled out for extra prompts of the same stage.

    Args:
        max_rounds: Refill rounds per batch at most; each rolls out as many extra prompts as groups are missing.
            At the cap the missing groups are filled with dropped ones (zero advantage, KL only), so every batch
            keeps its size (every DDP rank runs the same number of backward passes) and a collapsed run still
            steps rather than loop.
    """

    max_rounds: int = 2

    def __post_init__(self):
        if self.max_rounds < 0:
            raise SettingsError(f"model.dynamic_sampling.max_rounds must be >= 0, got {self.max_rounds}")


@dataclass
class VllmSettings:
    """The vLLM engine's options (`model.vllm`, read when `model.rollout_engine: vllm`).

    Args:
        gpu_memory_utilization: Share of the GPU's memory the engine may take for its weights and KV cache; the
            trainer's weights, optimizer state and activations live in the rest (docs/SCALING.md). On a CPU, vLLM
            reads it as a share of the machine's memory.
        kv_cache_memory_bytes: Exact KV-cache size in bytes instead of a share; None sizes it from the share.
        max_model_len: Longest prompt + completion in tokens; None takes the model's own limit.
        enforce_eager: Skip CUDA graphs and compilation (quicker start, slower decoding).
        enable_sleep_mode: Free the engine's KV cache and move its weights off the GPU while the policy updates
            (GPU only).
        max_lora_rank: Largest LoRA rank the engine reserves room for; None takes the adapter's rank.
        importance_sampling_correction: Weight each token's policy-gradient term by the truncated importance ratio
            between the trainer's and the engine's log-probs (TRL's `vllm_importance_sampling_correction`): the
            engine's numerics (bf16 kernels, another attention) sample from a slightly different policy.
        importance_sampling_cap: Upper bound of that ratio (TRL's `vllm_importance_sampling_cap`).
        seed_each_request: Give every prompt of a rollout its own seed, drawn from the trainer's generator, so a
            rollout is reproducible from the generator's state (a resumed run samples what the first one would have).
            Seeded requests take vLLM's one-request-at-a-time sampling path, slower on a GPU; off (as in TRL), the
            engine's own stream, seeded once at its start, draws every rollout.
    """

    gpu_memory_utilization: float = 0.3
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool = False
    enable_sleep_mode: bool = False
    max_lora_rank: int | None = None
    importance_sampling_correction: bool = False
    importance_sampling_cap: float = 2.0
    seed_each_request: bool = False

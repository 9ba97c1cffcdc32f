"""How the training rollout samples (`model.sampling`), DAPO's refill (`model.dynamic_sampling`) and the vLLM
engine's options (`model.vllm`)."""

from __future__ import annotations

from dataclasses import dataclass

from interleave_model.settings import SettingsError


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

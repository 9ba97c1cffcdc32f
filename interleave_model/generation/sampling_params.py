"""What one rollout samples with: the value the `Sampler` builds once per rollout and hands to the engine.

vLLM's `SamplingParams` and torchtune's generation take one such value; every engine here takes it too
(`rollout.sample`, `speculative.speculative_sample`, `VllmEngine.rollout`), so a setting is followed from the config
to the engine through one type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Speculation:
    """The own sampler's speculative sampling (`speculative.speculative_sample`).

    Args:
        sources: Each prompt's tokens the draft copies from (its target); the first stop id is appended to each.
        draft_tokens: k, the tokens drafted per step.
        ngram: The longest suffix of an answer the draft looks up.
        max_rows: Draft only in a step of at most this many rows, else decode one token (vLLM's
            `disable_by_batch_size`); None: draft in every step.
    """

    sources: Sequence[Sequence[int]]
    draft_tokens: int
    ngram: int
    max_rows: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How one rollout samples.

    Args:
        num_generations: Completions per prompt (G).
        max_new_tokens: The token budget of each completion.
        stop_ids: Token ids that end a completion (the model's EOS ids, `policy.stop_token_ids`); a row ends at the
            first of any of them, as HF `generate` does with a list of `eos_token_id`.
        temperature: 0 means greedy.
        top_p: Nucleus sampling mass; 1 keeps all.
        top_k: Keep the k most likely tokens; 0 keeps all.
        with_logprobs: The own sampler also returns each sampled token's log-prob at `temperature` (as the trainer
            scores it: softmax of the logits over the temperature, before top-k / top-p). vLLM returns its log-probs
            whenever it samples (not greedy).
        speculation: Drafts for the own sampler's speculative sampling; None decodes one token a step.
    """

    num_generations: int
    max_new_tokens: int
    stop_ids: Sequence[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    with_logprobs: bool = False
    speculation: Speculation | None = None

"""Which engine samples the answers: the project's own sampler (`rollout.py`) or colocated vLLM (`vllm_engine.py`).

Training, validation, test and predict all sample through one `Sampler`, within the token budget a batch's targets
need, so the two engines differ only in where the tokens come from. The own sampler draws a LoRA policy's held-out
answers from the policy merged into its own dtype (`MergedCopy`): the same function, one matmul an adapted layer instead
of three.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from transformers import PreTrainedTokenizerBase

from interleave_model.generation.merged_copy import MergedCopy, fastest_copy
from interleave_model.generation.rollout import Rollout, answer_budget, rollout, sample, token_budget
from interleave_model.generation.sampling_params import SamplingParams, Speculation
from interleave_model.generation.speculative import speculative_sample
from interleave_model.generation.vllm_engine import VllmEngine
from interleave_model.model.policy import TINY, is_peft
from interleave_model.model.positions import refuse_coupled
from interleave_model.runtime.machine import warn
from interleave_model.settings.sampling import Sampling, VllmSettings

# vLLM 0.32's own `ngram` speculation keeps greedy answers but returns wrong log-probs for some sampled tokens
# (docs/RESULTS.md, "Speculative sampling"), which the update divides by: the engine samples without it
VLLM_SPECULATION = (
    "model.sampling.speculative_tokens: the own sampler's speculation; vLLM samples without "
    "speculation, since its ngram method returns wrong log-probs for some sampled tokens"
)

AUTO_PROBE_TOKENS = 16  # decode steps of each dtype's timed rollout, `merged_copy: auto`
AUTO_PROBE_DRAWS = 5  # timed rollouts of each choice after a warm-up, their median kept


class Sampler:
    """Answers to a batch's prompts from the policy, by the engine `model.rollout_engine` names.

    Args:
        policy: The policy (LoRA-wrapped or not); the engine serves its weights of the current step.
        tokenizer: Its tokenizer (the own sampler decodes with it; the vLLM engine is handed it).
        stop_ids: The ids that end a completion.
        engine: "own" or "vllm".
        sampling: top_p, top_k and the token budget (`max_new_tokens`, `budget_margin`); the temperature comes with
            each call (training and evaluation sample at their own).
        model_name_or_path: The folder or hub name vLLM loads the model from; the tiny model is handed over in memory.
        vllm: The vLLM engine's options.
        seed: Seed of the vLLM engine, offset by the rank.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: list[int],
        engine: Literal["own", "vllm"] = "own",
        sampling: Sampling | None = None,
        model_name_or_path: str = TINY,
        vllm: VllmSettings | None = None,
        seed: int = 0,
    ) -> None:
        self.policy, self.tokenizer, self.stop_ids = policy, tokenizer, stop_ids
        self.kind, self.sampling = engine, sampling or Sampling()
        self.model_path = None if model_name_or_path == TINY else model_name_or_path
        self.vllm, self.seed = vllm, seed
        self.engine: VllmEngine | None = None  # built at the first rollout when the kind is "vllm"
        self.copy: MergedCopy | None = None  # built at the first training rollout with `sampling.merged_copy`
        self.held_out: MergedCopy | None = None  # a LoRA policy merged in its dtype, during an evaluation (own sampler)
        if engine == "vllm":
            refuse_coupled(policy, "model.rollout_engine: vllm")

    def rollout(
        self,
        batch: dict,
        num_generations: int,
        temperature: float,
        generator: torch.Generator | None = None,
        version: int = 0,
        rank: int = 0,
        training: bool = False,
    ) -> Rollout:
        """Answers to a batch's prompts, with the configured top-p / top-k, within the budget its targets need (a
        `training` rollout) or the held-out budget of its length (`answer_budget`): one `SamplingParams` (`params`)
        handed to the engine.

        `version` names the policy's weights (the global step): the engine (or the merged copy) takes them again
        when it changes. A `training` rollout hands the engine's KV memory to the update after sampling (sleep mode
        on a GPU), and the own sampler draws it from the merged copy when `sampling.merged_copy` is set.
        """
        params = self.params(batch, num_generations, temperature, training)
        if self.kind == "vllm":
            engine = self._vllm_engine(version, rank)
            roll = engine.rollout(batch["prompt_ids"], batch["prompt_mask"], params, generator)
            if training:
                engine.sleep()
            return roll
        model = self.policy
        if training and self.sampling.merged_copy is not None:
            self.copy = self.copy or self._merged_copy(batch, params)
            model = self.copy.refresh(version)
        elif not training:
            model = self._held_out_model(version)
        draw = sample if params.speculation is None else speculative_sample
        return rollout(model, self.tokenizer, batch["prompt_ids"], batch["prompt_mask"], params, generator, draw)

    def params(self, batch: dict, num_generations: int, temperature: float, training: bool) -> SamplingParams:
        """What a rollout of `batch` samples with: the settings' top-p / top-k, the budget its targets need (a
        `training` rollout) or its length's held-out budget, the log-probs of a merged copy's tokens, and the own
        sampler's drafts copied from the targets (exact whatever they are)."""
        s, own = self.sampling, self.kind == "own"
        speculation = None
        if own and s.speculative_tokens:
            speculation = Speculation(batch["target_ids"], s.speculative_tokens, s.speculative_ngram,
                                      s.speculative_max_rows)  # fmt: skip
        return SamplingParams(
            num_generations=num_generations,
            max_new_tokens=self.budget(batch["target_ids"]) if training else self.eval_budget(batch),
            stop_ids=tuple(self.stop_ids),
            temperature=temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            with_logprobs=own and training and s.merged_copy is not None,
            speculation=speculation,
        )

    def _held_out_model(self, version: int) -> torch.nn.Module:
        """The model the own sampler draws held-out answers from: a LoRA policy merged into weights of its own dtype
        (float32 or bfloat16), the policy's function up to rounding (`test_merged_copy.py` checks its samples and
        log-probs equal) with one matmul an adapted layer instead of three (`copy_float32` against `lora_no_autocast`
        in benchmarks/results/decode-levers.jsonl), refreshed when `version` changed; any other policy itself. Kept
        until `evaluation_ended`."""
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(next(self.policy.parameters()).dtype)
        if not is_peft(self.policy) or dtype is None:
            return self.policy
        self.held_out = self.held_out or MergedCopy(self.policy, dtype)
        return self.held_out.refresh(version)

    def evaluation_ended(self) -> None:
        """An evaluation's last batch was answered: its merged copy is freed (its memory is the base model's again)."""
        self.held_out = None

    def _merged_copy(self, batch: dict, params: SamplingParams) -> MergedCopy:
        """The configured merged copy; with "auto", the choice whose short rollout of this batch's first prompt runs
        fastest here (`fastest_copy`), said in one line with every choice's time and the host's spread."""
        rows = batch["prompt_ids"].shape[0] * params.num_generations  # a decode step's rows, the pack's hint
        if self.sampling.merged_copy != "auto":
            return MergedCopy(self.policy, self.sampling.merged_copy, rows)
        probe = replace(params, max_new_tokens=min(params.max_new_tokens, AUTO_PROBE_TOKENS), with_logprobs=True)
        ids, mask = batch["prompt_ids"][:1], batch["prompt_mask"][:1]

        def draw(model):  # a generator of its own: the training stream's draws untouched
            return rollout(model, self.tokenizer, ids, mask, probe, torch.Generator().manual_seed(0))

        chosen, seconds, spread = fastest_copy(self.policy, draw, rows, AUTO_PROBE_DRAWS)
        timed = ", ".join(f"{dtype} {s:.3f} s" for dtype, s in seconds.items())
        rank_zero_info(f"model.sampling.merged_copy: auto samples from the {chosen.dtype} copy, the fastest here "
                       f"(median of {AUTO_PROBE_DRAWS}: {timed} for {probe.max_new_tokens} tokens of one group; "
                       f"the draws of one choice spread {spread:.0%})")  # fmt: skip
        return chosen

    def budget(self, target_ids: list[list[int]]) -> int:
        """Token budget for a batch's targets (their token ids, from `collate`)."""
        return self.budget_for(max(len(ids) for ids in target_ids))

    def eval_budget(self, batch: dict) -> int:
        """Token budget of a held-out batch: its longest length's `answer_budget`, or more where a target needs it.

        With a tokenizer of at most about 2.3 tokens a word (real models' on the default corpus), that is the
        length's `answer_budget` whatever the batch; a finer one gets the training rule's room over its longest target.
        """
        longest = max(len(ids) for ids in batch["target_ids"])
        return max(answer_budget(max(batch["n_words"])), token_budget([longest], margin=self.sampling.budget_margin))

    def budget_for(self, longest: int) -> int:
        """Token budget for targets of at most `longest` tokens; a fixed budget that cannot hold them is refused, not
        silently truncating."""
        needed = longest + 1  # + EOS
        fixed = self.sampling.max_new_tokens
        if fixed is not None:
            if fixed < needed:
                raise ValueError(
                    f"model.sampling.max_new_tokens={fixed} cannot hold a {needed}-token answer of this stage; "
                    "raise it or leave it null to size the budget from the targets"
                )
            return fixed
        return token_budget([longest], margin=self.sampling.budget_margin)

    def importance_sampling_cap(self, roll: Rollout) -> float | None:
        """The cap of the truncated importance weights when the engine sampled `roll` and the correction is on."""
        if roll.logprobs is None:
            return None
        if self.kind == "own":
            return self.sampling.importance_sampling_cap
        settings = self.engine.settings if self.engine is not None else None
        if settings is None or not settings.importance_sampling_correction:
            return None
        return settings.importance_sampling_cap

    def weights_loaded(self) -> None:
        """The policy's weights were replaced (a checkpoint loaded): they reach the engine before its next rollout."""
        if self.engine is not None:
            self.engine.version = None
        if self.copy is not None:
            self.copy.version = None
        self.held_out = None

    def close(self) -> None:
        """Shut the vLLM engine down, its KV cache freed: the next rollout builds a fresh one. An engine left standing
        keeps its share of the memory, and a second fit in this process (the rehearsal's resume) would build another
        beside it."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _vllm_engine(self, version: int, rank: int) -> VllmEngine:
        """The colocated engine, built at the first rollout, serving the policy's weights of this version."""
        if self.engine is None:
            if self.sampling.speculative_tokens:
                warn(VLLM_SPECULATION)
            seed = self.seed + rank
            self.engine = VllmEngine(self.policy, self.tokenizer, self.model_path, self.vllm, seed=seed)
        self.engine.serve(self.policy, version=version)
        return self.engine

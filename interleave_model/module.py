"""The LightningModule: a GRPO step is rollout -> rewards -> advantages -> clipped loss with KL to a reference."""

from __future__ import annotations

import contextlib
import math
import random
import time
import warnings
from collections.abc import Iterator
from typing import Literal, NamedTuple

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from interleave_data.corpus import load_corpus
from interleave_data.prompts import format_prompt
from interleave_model import grpo
from interleave_model.alignment import align
from interleave_model.checkpoint import BASE_OMITTED, check_weight_keys, frozen_weight_keys, load_initial_weights
from interleave_model.dynamic_sampling import DynamicSampling, refill
from interleave_model.evaluation import SampledAnswers, length_row, resolve_pass_k
from interleave_model.logprobs import completion_logits, completion_logprobs
from interleave_model.metric import AlignmentScore
from interleave_model.policy import (
    TINY,
    LoraSettings,
    TinyModelConfig,
    apply_lora,
    build_tiny_model,
    build_tiny_tokenizer,
    frozen_copy,
    is_peft,
    load_pretrained,
    stop_token_ids,
    zero_dropout,
)
from interleave_model.preflight import preflight
from interleave_model.rewards import AlignmentReward, RewardFunction, combine
from interleave_model.rollout import Rollout, rollout, token_budget
from interleave_model.schedule import LrSchedule, lr_factor
from interleave_model.vllm_engine import VllmEngine, VllmSettings, truncated_importance_weights

# Under manual optimization Lightning warns at every checkpoint that it holds the state after the optimizer step.
# That is the state we want: global_step counts completed steps, and resuming from it is exact (tests/test_resume.py).
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")

# Checkpoints keep these settings in their hyperparameters; torch.load(weights_only=True) must accept them.
torch.serialization.add_safe_globals([TinyModelConfig, LoraSettings, DynamicSampling, VllmSettings])


class Trajectory(NamedTuple):
    """Everything the update needs from one rollout, group-major over P prompts x G completions."""

    input_ids: Tensor  # [P*G, Lp+C] prompt then completion
    attention_mask: Tensor  # [P*G, Lp+C]
    completion_ids: Tensor  # [P*G, C]
    completion_mask: Tensor  # [P*G, C]
    old_logprobs: Tensor | None  # [P*G, C], None when num_iterations == 1 (then old = current, detached)
    ref_logprobs: Tensor | None  # [P*G, C], None when beta == 0
    rewards: Tensor  # [P*G]
    advantages: Tensor  # [P*G]
    rollout: Rollout


class StepRecord(NamedTuple):
    """What a GRPO step hands to callbacks, as `outputs["record"]` of `on_train_batch_end`; group-major.

    Describes the batch as drawn, before any dynamic-sampling refill, so callbacks see collapse as it happens.
    """

    prompts: list[str]  # [P]
    targets: list[str]  # [P]
    n_words: list[int]  # [P]
    completions: list[str]  # [P*G]
    rewards: Tensor  # [P*G]
    num_generations: int


class InterleaveGRPO(L.LightningModule):
    """Policy, frozen reference and GRPO loss for word interleaving.

    Args:
        model_name_or_path: A local HF model folder, a hub name (when online), or "tiny" for the embedded tiny Llama.
        tiny: Shape of the embedded tiny model (used only when model_name_or_path is "tiny").
        corpus: Corpus sources whose words form the tiny tokenizer's vocabulary (linked from `data.corpus`).
        template: Prompt template whose words join the tiny vocabulary (linked from `data.template`).
        dtype: Weights dtype when loading ("bfloat16", "float32", "auto"); mixed precision is the trainer's.
        attn_implementation: Passed to `from_pretrained` ("sdpa", "eager", "flash_attention_2").
        trust_remote_code: Allow model code from the model folder. Off unless you trust it.
        lora: LoRA settings; None trains all weights.
        gradient_checkpointing: Recompute activations in the backward pass (less memory, ~30% more time).
        disable_dropout: Set every dropout of the policy (adapter included) to 0, as TRL does by default: the ratio
            then compares equal forwards, and is exactly 1 at a rollout's first update.
        seed: Seed of the tiny model's init and of the sampling RNG (offset by rank).
        num_generations: Completions per prompt (G); group-relative advantages need at least 2.
        temperature: Sampling temperature of the rollout (and of the log-probs, as in TRL).
        top_p: Nucleus sampling mass.
        top_k: Keep the k most likely tokens; 0 keeps all.
        max_new_tokens: Fixed token budget; None sizes it per batch from the targets' token lengths.
        budget_margin: Share of the longest target's token length added to the automatic budget.
        beta: KL coefficient; 0 skips the reference forward entirely.
        kl_estimator: "k1", "k2" or "k3". As a loss term k1's expected gradient is zero (see `grpo.kl_divergence`),
            so `beta > 0` with k1 warns.
        epsilon: Lower clip of the ratio (1 - epsilon).
        epsilon_high: Upper clip (1 + epsilon_high), "clip-higher"; None means epsilon.
        num_iterations: Updates per rollout (mu); above 1 the old log-probs are computed once and reused.
        loss_type: "grpo" (sequence mean), "dr_grpo" (constant normaliser) or "dapo" (token level: the tokens of all
            ranks).
        max_completion_length: The constant length of "dr_grpo"'s normaliser, token sum / (N * this) (TRL's name);
            None means `max_new_tokens`. "dr_grpo" needs one of the two: a normaliser taken from the batch's longest
            completion would reweight every token by how long its batch happened to run.
        scale_rewards: "group", "batch" (the reward std of all ranks) or "none" (Dr. GRPO).
        advantage_estimator: "grpo" (group mean baseline) or "rloo" (leave-one-out).
        rewards: Reward functions with weights; the alignment score alone by default.
        learning_rate: Peak learning rate of the GRPO phase.
        sft_learning_rate: Peak learning rate of the supervised warm-start phase.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps.
        lr_schedule: Schedule of the GRPO phase after warm-up: "cosine" (to 10% at trainer.max_steps) or "constant".
            The SFT phase always decays by a cosine over its own `sft_steps`.
        sft_steps: Supervised warm-start steps before GRPO (linked from `data.sft_steps`, which schedules the data).
        max_grad_norm: Gradient clipping norm; 0 disables.
        micro_batch_size: Rows per forward in the update (gradient accumulation inside a step); None = all rows.
        dynamic_sampling: Drop zero-variance groups and refill from extra prompts (DAPO); None (default) = off.
        init_from: Start from the weights of an earlier run: its `.ckpt`, or a stage folder it exported
            (`<run>/stages/<N>words`, a full model or a LoRA adapter). Optimizer and curriculum start afresh.
        eval_num_samples: Answers sampled per prompt in validation / test for pass@k and diversity (n); 0 = greedy
            only. Sampled with `eval_temperature`, `top_p` and `top_k`, seeded by `seed`, the length and the batch.
        eval_temperature: Sampling temperature of those answers.
        pass_k: The k of each pass@k reported, each <= eval_num_samples; None means [1, eval_num_samples].
        pass_threshold: Alignment score a sampled answer needs to count as correct for pass@k; 1.0 = exact match.
        rollout_engine: "own" (the project's sampler, `rollout.py`) or "vllm" (colocated vLLM, `vllm_engine.py`),
            used by training, validation, test and predict alike.
        vllm: The vLLM engine's options (memory share, max model length, eager mode, sleep mode).
    """

    def __init__(
        self,
        model_name_or_path: str = TINY,
        tiny: TinyModelConfig | None = None,
        corpus: list[str] | None = None,
        template: str = "two_processes",
        dtype: str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        gradient_checkpointing: bool = False,
        disable_dropout: bool = True,
        seed: int = 0,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int | None = None,
        budget_margin: float = 0.25,
        beta: float = 0.04,
        kl_estimator: grpo.KlEstimator = "k3",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        num_iterations: int = 1,
        loss_type: grpo.LossType = "grpo",
        max_completion_length: int | None = None,
        scale_rewards: grpo.ScaleRewards = "group",
        advantage_estimator: grpo.AdvantageEstimator = "grpo",
        rewards: list[RewardFunction] | None = None,
        learning_rate: float = 1e-5,
        sft_learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: LrSchedule = "cosine",
        sft_steps: int = 0,
        max_grad_norm: float = 1.0,
        micro_batch_size: int | None = None,
        dynamic_sampling: DynamicSampling | None = None,
        init_from: str | None = None,
        eval_num_samples: int = 0,
        eval_temperature: float = 1.0,
        pass_k: list[int] | None = None,
        pass_threshold: float = 1.0,
        rollout_engine: Literal["own", "vllm"] = "own",
        vllm: VllmSettings | None = None,
    ) -> None:
        super().__init__()
        if num_generations < 2:
            raise ValueError(f"model.num_generations must be >= 2 for group-relative advantages, got {num_generations}")
        if max_completion_length is not None and max_completion_length < 1:
            raise ValueError(f"model.max_completion_length must be >= 1, got {max_completion_length}")
        if loss_type == "dr_grpo" and (max_completion_length or max_new_tokens) is None:
            raise ValueError("model.loss_type: dr_grpo needs model.max_completion_length (or a fixed max_new_tokens)")
        if kl_estimator == "k1" and beta > 0:
            rank_zero_warn(
                "model.kl_estimator: k1 has zero expected gradient as a loss term, so beta > 0 regularises nothing; "
                "use k3 (or k2)"
            )
        self.pass_k = resolve_pass_k(eval_num_samples, pass_k)
        if rollout_engine not in ("own", "vllm"):
            raise ValueError(f"model.rollout_engine must be 'own' or 'vllm', got {rollout_engine!r}")
        self.save_hyperparameters(ignore=["rewards"])
        self.automatic_optimization = False  # a rollout may feed several updates (num_iterations) and bad steps skip
        self.reward_functions = list(rewards) if rewards else [AlignmentReward()]
        # saved hyperparameters hold these settings as plain dicts (load_from_checkpoint passes them back so)
        tiny = TinyModelConfig(**tiny) if isinstance(tiny, dict) else tiny or TinyModelConfig()
        lora = LoraSettings(**lora) if isinstance(lora, dict) else lora
        self.policy, self.tokenizer = self._load_policy(tiny)
        self.stop_ids = stop_token_ids(self.policy, self.tokenizer)
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        if init_from is not None:
            load_initial_weights(self.policy, init_from)
        if disable_dropout:
            zero_dropout(self.policy)
        if gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.policy.enable_input_require_grads()
        # Without LoRA, the reference is a frozen copy of the policy as GRPO starts (after any warm-start).
        self.reference: torch.nn.Module | None = None
        self.metrics = torch.nn.ModuleDict()  # length -> AlignmentScore of greedy answers
        self.sample_metrics = torch.nn.ModuleDict()  # length -> SampledAnswers (when eval_num_samples > 0)
        self.eval_results: dict | None = None  # the last evaluation's table, for the report writer
        self.skipped_steps = 0
        self._rng: torch.Generator | None = None
        self._engine: VllmEngine | None = None  # built at the first rollout when rollout_engine is "vllm"
        # LoRA on a base from disk: checkpoints leave the frozen base out, so loading them is not strict (the keys
        # are checked in on_load_checkpoint instead)
        self.strict_loading = not self._base_from_disk()

    def _load_policy(self, tiny: TinyModelConfig):
        hp = self.hparams
        if hp.model_name_or_path != TINY:
            return load_pretrained(hp.model_name_or_path, hp.dtype, hp.attn_implementation, hp.trust_remote_code)
        texts = [t.words for t in load_corpus(hp.corpus).texts]
        tokenizer = build_tiny_tokenizer(texts, extra_words=format_prompt("", "", hp.template).split())
        return build_tiny_model(tokenizer, tiny, seed=hp.seed), tokenizer

    # ---------------------------------------------------------------- Lightning hooks

    def on_fit_start(self) -> None:
        # from_pretrained returns a model in eval mode; HF's gradient checkpointing (and dropout) act only in train
        # mode. The reference too: it runs its own forwards in eval mode (_reference), and Lightning warns otherwise.
        self.train()

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            preflight(self, datamodule)  # bad input is one line now, not after the warm-start

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay)

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        record = None
        if batch["phase"] == "sft":
            stats = self.sft_step(batch)
        else:
            trajectory, stats = self.generate_trajectory(batch)
            roll, G = trajectory.rollout, self.hparams.num_generations
            record = StepRecord(batch["prompts"], batch["targets"], batch["n_words"], roll.texts, trajectory.rewards, G)
            if self.hparams.dynamic_sampling is not None:
                trajectory, counts = refill(self, batch, trajectory)
                stats |= counts
            if self.hparams.scale_rewards == "batch":  # every rank holds its final batch now (refill rounds differ)
                trajectory = trajectory._replace(advantages=self._batch_scaled_advantages(trajectory.rewards))
            for _ in range(self.hparams.num_iterations):
                stats |= self.grpo_step(trajectory)
        self.log_dict(stats, batch_size=len(batch["targets"]))
        # replayed rows come last in a batch; its stage is its longest length
        self.log("stage", float(max(batch["n_words"])), prog_bar=True, batch_size=1)
        return {"record": record}

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, batch_idx)

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val")

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test")

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """One record per prompt: the greedy completion, its alignment diagnostics and any sampled answers."""
        groups = self._sampled(batch, batch_idx) if self.hparams.eval_num_samples else None
        records = []
        for i, text in enumerate(self.greedy(batch)):
            target = batch["targets"][i]
            diagnostics = align(text, target)
            record = {
                "id": batch["ids"][i],
                "n_words": batch["n_words"][i],
                "prompt": batch["prompts"][i],
                "target": target,
                "completion": text,
                "score": diagnostics.score,
                "exact_match": diagnostics.distance == 0,
                "distance": diagnostics.distance,
                "first_error": diagnostics.first_error,
                "relative_first_error": diagnostics.relative_first_error,
                "a_accuracy": diagnostics.a_accuracy,
                "b_accuracy": diagnostics.b_accuracy,
                "substitutions": diagnostics.substitutions,
                "insertions": diagnostics.insertions,
                "deletions": diagnostics.deletions,
                "n_pred": diagnostics.n_pred,
                "n_target": diagnostics.n_target,
            }
            if groups is not None:
                record["samples"] = groups[i]
                record["sample_scores"] = [align(answer, target).score for answer in groups[i]]
            records.append(record)
        return records

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["sampling_rng"] = self._generator().get_state()
        # the global RNG draws LoRA's dropout masks; with it a resumed run continues them exactly
        checkpoint["torch_rng"] = torch.get_rng_state()
        if self.device.type == "cuda":
            checkpoint["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        checkpoint["skipped_steps"] = self.skipped_steps
        if self._base_from_disk():
            omitted = frozen_weight_keys(self.policy, prefix="policy.")
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in omitted}
            checkpoint[BASE_OMITTED] = self.hparams.model_name_or_path

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if BASE_OMITTED in checkpoint:
            source = f"the checkpoint's LoRA weights (base {checkpoint[BASE_OMITTED]})"
            check_weight_keys(self.policy, set(checkpoint["state_dict"]), source, prefix="policy.")
        if "sampling_rng" in checkpoint:
            self._generator().set_state(checkpoint["sampling_rng"])
        if "torch_rng" in checkpoint:
            torch.set_rng_state(checkpoint["torch_rng"])
        if "cuda_rng" in checkpoint and self.device.type == "cuda":
            torch.cuda.set_rng_state(checkpoint["cuda_rng"], self.device)
        self.skipped_steps = checkpoint.get("skipped_steps", 0)
        if self._engine is not None:
            self._engine.version = None  # the loaded weights reach the engine before its next rollout
        if self.reference is None and any(k.startswith("reference.") for k in checkpoint["state_dict"]):
            self.reference = frozen_copy(self.policy)  # its weights come from the checkpoint right after

    # ---------------------------------------------------------------- the algorithm

    def generate_trajectory(self, batch: dict) -> tuple[Trajectory, dict[str, float]]:
        """Sample G completions per prompt, score them, and compute advantages and fixed log-probs."""
        hp = self.hparams
        G = hp.num_generations
        started = time.perf_counter()
        with _eval_mode(self.policy):  # the update trains; sampling runs as evaluation does (HF caches only so)
            roll = self._rollout(batch, G, hp.temperature, self._generator())
        rolled = time.perf_counter()
        targets = [t for t in batch["targets"] for _ in range(G)]
        rewards, terms = combine(self.reward_functions, roll.texts, targets, roll.truncated.tolist())
        rewards = torch.tensor(rewards, dtype=torch.float32, device=self.device)  # [P*G]
        advantages = grpo.group_advantages(rewards, G, hp.scale_rewards, hp.advantage_estimator)  # [P*G]
        scored = time.perf_counter()

        input_ids = torch.cat([roll.prompt_ids, roll.completion_ids], dim=1)  # [P*G, Lp+C]
        attention_mask = torch.cat([roll.prompt_mask, roll.completion_mask], dim=1)  # [P*G, Lp+C]
        with torch.no_grad():
            # with one update per rollout the old policy is the current one: grpo_step uses its own detached log-probs
            old = None
            if hp.num_iterations > 1:
                old = self._logprobs(self.policy, input_ids, attention_mask, roll.completion_ids)
            ref = self._reference_logprobs(input_ids, attention_mask, roll.completion_ids) if hp.beta > 0 else None
            gap = None
            if roll.logprobs is not None:  # how far the engine's numerics are from the trainer's (off-policy gap)
                trainer = (
                    self._logprobs(self.policy, input_ids, attention_mask, roll.completion_ids) if old is None else old
                )
                gap = grpo.masked_mean((trainer - roll.logprobs).abs(), roll.completion_mask.float()).item()
        trajectory = Trajectory(
            input_ids, attention_mask, roll.completion_ids, roll.completion_mask, old, ref, rewards, advantages, roll
        )
        zero_std = grpo.zero_std_groups(rewards, G)  # [P]
        stats = {
            "train/reward_mean": rewards.mean().item(),
            "train/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "train/frac_zero_std_groups": zero_std.float().mean().item(),
            "train/advantage_abs_mean": advantages.abs().mean().item(),
            "train/completion_len": roll.completion_mask.sum(-1).float().mean().item(),
            "train/truncated_frac": roll.truncated.float().mean().item(),
            "time/rollout_s": rolled - started,
            "time/reward_s": scored - rolled,
        }
        stats |= {f"train/reward_{name}": sum(v) / len(v) for name, v in terms.items()}
        if gap is not None:
            stats["train/engine_logprob_gap"] = gap
        self.log("reward", stats["train/reward_mean"], prog_bar=True, batch_size=1)
        return trajectory, stats

    def grpo_step(self, trajectory: Trajectory) -> dict[str, float]:
        """One clipped policy-gradient update on a trajectory, in micro-batches of rows."""
        hp = self.hparams
        started = time.perf_counter()
        mask = trajectory.completion_mask.float()  # [N, C]
        n_rows = mask.shape[0]
        total_tokens = mask.sum().clamp(min=1.0)
        num_tokens = None
        if hp.loss_type == "dapo":  # the tokens of every rank; DDP then averages the ranks' gradients
            num_tokens = self._sum_over_ranks(mask.sum()).clamp(min=1.0).item() / self.trainer.world_size
        totals: dict[str, float] = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0}
        optimizer = self.optimizers()
        optimizer.zero_grad()
        for rows in self._row_chunks(n_rows):
            ids, attention = trajectory.input_ids[rows], trajectory.attention_mask[rows]
            logprobs, entropy = completion_logprobs(
                self.policy, ids, attention, trajectory.completion_ids[rows], hp.temperature, with_entropy=True
            )  # [n, C] each
            old = trajectory.old_logprobs[rows] if trajectory.old_logprobs is not None else logprobs.detach()
            ref = trajectory.ref_logprobs[rows] if trajectory.ref_logprobs is not None else None
            out = grpo.policy_loss(
                logprobs, old, trajectory.advantages[rows], mask[rows], epsilon=hp.epsilon,
                epsilon_high=hp.epsilon_high, ref_logprobs=ref, beta=hp.beta, kl_estimator=hp.kl_estimator,
                loss_type=hp.loss_type, max_completion_length=hp.max_completion_length or hp.max_new_tokens,
                num_tokens=num_tokens, importance_weights=self._importance_weights(trajectory.rollout, old, rows),
            )  # fmt: skip
            # each chunk's share of the whole-batch aggregate: its rows for sequence-level losses ("dapo" divides
            # by the batch's token count already); the per-token statistics are token-weighted whatever the loss type
            token_share = (mask[rows].sum() / total_tokens).item()
            share = 1.0 if hp.loss_type == "dapo" else (rows.stop - rows.start) / n_rows
            self.manual_backward(out.loss * share)
            entropy = grpo.masked_mean(entropy, mask[rows])
            totals["loss"] += out.loss.item() * share
            totals["pg_loss"] += out.pg_loss.item() * share
            for key, value in (("kl", out.kl), ("clip_frac", out.clip_frac), ("entropy", entropy)):
                totals[key] += value.item() * token_share
        self._step_optimizer(totals["loss"], "grpo")
        stats = {f"train/{k}": v for k, v in totals.items()}
        stats["time/update_s"] = time.perf_counter() - started
        return stats

    def sft_step(self, batch: dict) -> dict[str, float]:
        """Supervised warm-start: cross-entropy on the target tokens (and EOS) only."""
        started = time.perf_counter()
        input_ids, attention_mask, labels = self._sft_inputs(batch)  # [B, Lp+T] each
        optimizer = self.optimizers()
        optimizer.zero_grad()
        logits = completion_logits(self.policy, input_ids, attention_mask, width=labels.shape[1])  # [B, T, V]
        loss = grpo.sft_loss(logits, labels)
        self.manual_backward(loss)
        self._step_optimizer(loss.item(), "sft")
        return {"train/sft_loss": loss.item(), "time/update_s": time.perf_counter() - started}

    # ---------------------------------------------------------------- pieces

    def greedy(self, batch: dict) -> list[str]:
        """Greedy answers, one per prompt (evaluation)."""
        return self._rollout(batch, num_generations=1, temperature=0.0).texts

    def _rollout(
        self, batch: dict, num_generations: int, temperature: float, generator: torch.Generator | None = None
    ) -> Rollout:
        """Answers to a batch's prompts, within the budget its targets need, with the configured top-p / top-k."""
        kwargs = {"num_generations": num_generations, "max_new_tokens": self._budget(batch["target_ids"]),
                  "temperature": temperature, "top_p": self.hparams.top_p, "top_k": self.hparams.top_k,
                  "generator": generator}  # fmt: skip
        if self.hparams.rollout_engine == "own":
            return rollout(
                self.policy, self.tokenizer, batch["prompt_ids"], batch["prompt_mask"], self.stop_ids, **kwargs
            )
        engine = self._vllm_engine()
        roll = engine.rollout(batch["prompt_ids"], batch["prompt_mask"], **kwargs)
        if self.training:
            engine.sleep()  # the update gets the engine's KV memory (sleep mode on a GPU)
        return roll

    def _importance_weights(self, roll: Rollout, old: Tensor, rows: slice) -> Tensor | None:
        """The truncated importance weights of these rows when the engine sampled them and the correction is on."""
        settings = self._engine.settings if self._engine is not None else None
        if roll.logprobs is None or settings is None or not settings.importance_sampling_correction:
            return None
        return truncated_importance_weights(old, roll.logprobs[rows], settings.importance_sampling_cap)

    def _vllm_engine(self) -> VllmEngine:
        """The colocated engine, built at the first rollout, serving the policy's weights of this step."""
        hp = self.hparams
        if self._engine is None:
            path = None if hp.model_name_or_path == TINY else hp.model_name_or_path
            seed = hp.seed + self.global_rank
            self._engine = VllmEngine(self.policy, self.tokenizer, path, self.stop_ids, hp.vllm, seed=seed)
        # every optimizer step moves global_step, so a new step means new weights
        self._engine.serve(self.policy, version=self.global_step)
        return self._engine

    def _evaluate(self, batch: dict, batch_idx: int) -> None:
        """Greedy answers into the length's AlignmentScore; sampled groups into its SampledAnswers."""
        length = str(batch["n_words"][0])
        if length not in self.metrics:
            self.metrics[length] = AlignmentScore().to(self.device)
        self.metrics[length].update(self.greedy(batch), batch["targets"])
        if self.hparams.eval_num_samples:
            if length not in self.sample_metrics:
                metric = SampledAnswers(self.pass_k, threshold=self.hparams.pass_threshold)
                self.sample_metrics[length] = metric.to(self.device)
            self.sample_metrics[length].update(self._sampled(batch, batch_idx), batch["targets"])

    def _sampled(self, batch: dict, batch_idx: int) -> list[list[str]]:
        """`eval_num_samples` answers per prompt at `eval_temperature`, from an RNG of their own.

        The seed depends on the run's seed, the length, the batch and the rank only, so evaluation draws the same
        answers whenever it runs and never moves the training sampler's stream.
        """
        hp = self.hparams
        n = hp.eval_num_samples
        seed = random.Random(f"{hp.seed}:eval:{batch['n_words'][0]}:{batch_idx}:{self.global_rank}").getrandbits(63)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        texts = self._rollout(batch, n, hp.eval_temperature, generator).texts
        return [texts[i : i + n] for i in range(0, len(texts), n)]  # group-major: n answers per prompt

    def _log_metrics(self, prefix: str) -> None:
        """Log every measure per length as `{prefix}/{name}_{n}w` and keep the table in `eval_results`.

        Every rank runs this: the pair counts are reduced and the metrics synced, so all ranks log the same values.
        """
        rows = []
        for length in sorted(self.metrics, key=int):
            greedy = self.metrics[length]
            pairs = int(self.trainer.strategy.reduce(greedy.pairs.clone(), reduce_op="sum").item())
            sampled = self.sample_metrics[length] if length in self.sample_metrics else None
            if pairs:
                values = sampled.compute_all() if sampled is not None else None
                rows.append(length_row(int(length), pairs, greedy.compute_all(), values))
            greedy.reset()
            if sampled is not None:
                sampled.reset()
        for row in rows:
            for name, value in row.items():
                if name not in ("n_words", "pairs") and not math.isnan(value):
                    name = "alignment" if name == "score" else name
                    # already equal on every rank; sync_dist (a mean of equal values) only keeps Lightning quiet
                    self.log(f"{prefix}/{name}_{row['n_words']}w", value, batch_size=1, sync_dist=True)
        self.eval_results = {"split": prefix, "step": self.global_step, "lengths": rows}

    def _budget(self, target_ids: list[list[int]]) -> int:
        """Token budget for a batch; a fixed budget that cannot hold a target is refused, not silently truncating."""
        lengths = [len(ids) for ids in target_ids]
        needed = max(lengths) + 1  # + EOS
        fixed = self.hparams.max_new_tokens
        if fixed is not None:
            if fixed < needed:
                raise ValueError(
                    f"model.max_new_tokens={fixed} cannot hold a {needed}-token answer of this stage; "
                    "raise it or leave it null to size the budget from the targets"
                )
            return fixed
        return token_budget(lengths, margin=self.hparams.budget_margin)

    def _sft_inputs(self, batch: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Prompt + target + EOS, right-padded after the target; labels are -100 except on target and EOS tokens."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        answers = [ids + [eos] for ids in batch["target_ids"]]
        width = max(len(a) for a in answers)
        answer_ids = torch.full((len(answers), width), pad, dtype=torch.long)  # [B, T]
        labels = torch.full((len(answers), width), -100, dtype=torch.long)  # [B, T]
        for i, answer in enumerate(answers):
            answer_ids[i, : len(answer)] = torch.tensor(answer)
            labels[i, : len(answer)] = torch.tensor(answer)
        answer_ids, labels = answer_ids.to(self.device), labels.to(self.device)
        input_ids = torch.cat([batch["prompt_ids"], answer_ids], dim=1)  # [B, Lp+T]
        attention_mask = torch.cat([batch["prompt_mask"], (labels != -100).long()], dim=1)  # [B, Lp+T]
        return input_ids, attention_mask, labels

    def _logprobs(self, model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor):
        temperature, chunks = self.hparams.temperature, []
        for rows in self._row_chunks(input_ids.shape[0]):
            ids, attention = input_ids[rows], attention_mask[rows]
            chunks.append(completion_logprobs(model, ids, attention, completion_ids[rows], temperature)[0])
        return torch.cat(chunks)  # [N, C]

    def _reference_logprobs(self, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor) -> Tensor:
        with self._reference() as reference:
            return self._logprobs(reference, input_ids, attention_mask, completion_ids)

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The reference in eval mode: the policy with its adapter off under LoRA (no second copy), else a snapshot."""
        if is_peft(self.policy):
            with self.policy.disable_adapter(), _eval_mode(self.policy):
                yield self.policy
            return
        if self.reference is None:
            rank_zero_info("GRPO starts: freezing a copy of the policy as the KL reference")
            self.reference = frozen_copy(self.policy)
        with _eval_mode(self.reference):
            yield self.reference

    def _batch_scaled_advantages(self, rewards: Tensor) -> Tensor:
        """Advantages scaled by the reward std of every rank's batch, as one process holding them all would."""
        count = self._sum_over_ranks(rewards.new_tensor(float(rewards.numel())))
        mean = self._sum_over_ranks(rewards.sum()) / count
        squares = self._sum_over_ranks((rewards - mean).pow(2).sum())
        std = (squares / (count - 1).clamp(min=1.0)).sqrt()  # unbiased, as torch.std
        hp = self.hparams
        return grpo.group_advantages(rewards, hp.num_generations, "batch", hp.advantage_estimator, batch_std=std)

    def _sum_over_ranks(self, x: Tensor) -> Tensor:
        """The sum of a tensor over all ranks (the tensor itself on one process)."""
        return self.trainer.strategy.reduce(x.clone(), reduce_op="sum")

    def _row_chunks(self, n_rows: int) -> list[slice]:
        size = self.hparams.micro_batch_size or n_rows
        return [slice(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]

    def _step_optimizer(self, loss: float, phase: str) -> None:
        """Set the scheduled rate and step, unless the loss is not finite (then skip, count and log).

        Clipping, and skipping a step whose gradient norm is not finite, happen inside the step, in
        `on_before_optimizer_step`.
        """
        optimizer = self.optimizers()
        if not math.isfinite(loss):
            self._skip_step(optimizer)
            optimizer.step()
            return
        lr = self._learning_rate(phase)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        self.log("train/lr", lr, batch_size=1)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the step if the gradient norm is not finite, else clip: here the gradients are the true ones.

        Lightning calls this hook inside `optimizer.step()`, after a 16-mixed GradScaler has unscaled the gradients
        (once) and before the update; clipping before `step()` would clip the scaled gradients (to
        `max_grad_norm / scale`). Every rank reaches this hook once per step and agrees on the skip.
        """
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = bool(grads) and not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item()
        skip = self.trainer.strategy.reduce_boolean_decision(local, all=False)  # a collective: every rank calls it
        if not grads:  # dropped already: a non-finite loss skipped this step and counted it
            return
        if skip:
            self._skip_step(optimizer)
        elif self.hparams.max_grad_norm:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")

    def _skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients, so the coming `step()` is counted but moves nothing, and count the skip.

        AdamW skips parameters without a gradient, so neither the weights nor the optimizer state move, while the
        step still counts (max_steps and the LR schedule stay on time).
        """
        self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        self.log("train/skipped_steps", float(self.skipped_steps), batch_size=1)

    def _learning_rate(self, phase: str) -> float:
        """Each phase has its own schedule: SFT decays over its steps, GRPO warms up again from where SFT ended."""
        hp = self.hparams
        if phase == "sft":
            return hp.sft_learning_rate * lr_factor(self.global_step, hp.warmup_steps, hp.sft_steps, "cosine")
        step, total = self.global_step - hp.sft_steps, self.trainer.max_steps - hp.sft_steps
        return hp.learning_rate * lr_factor(max(step, 0), hp.warmup_steps, total, hp.lr_schedule)

    def _base_from_disk(self) -> bool:
        """LoRA on a model that `from_pretrained` loads again: its frozen base need not be in checkpoints."""
        return is_peft(self.policy) and self.hparams.model_name_or_path != TINY

    def _generator(self) -> torch.Generator:
        if self._rng is None or self._rng.device != self.device:
            self._rng = torch.Generator(device=self.device).manual_seed(self.hparams.seed + self.global_rank)
        return self._rng


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run a block with `model` in eval mode, then put back the mode it had."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)

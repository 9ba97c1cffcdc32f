"""The LightningModule: a GRPO step is rollout -> rewards -> advantages -> clipped policy loss, then the auxiliary
terms (KL to the reference, guidance); the supervised warm start is one path beside it."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict
from functools import partial
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import move_data_to_device, rank_zero_info
from torch import Tensor

from interleave_data.prompts import TemplateName
from interleave_model.algorithm import grpo
from interleave_model.algorithm.completions import (
    chunked_completion_logprobs,
    completion_logits,
    completion_logprobs,
    row_chunks,
)
from interleave_model.algorithm.dynamic_sampling import refill
from interleave_model.algorithm.guidance import guidance_weight
from interleave_model.algorithm.kl import kl_loss
from interleave_model.algorithm.ranks import batch_scaled_advantages, mean_over_ranks
from interleave_model.algorithm.records import StepRecord, Trajectory, stream_stats, trajectory_stats
from interleave_model.algorithm.rewards import FIELDS, AlignmentReward, RewardFunction, combine
from interleave_model.algorithm.schedule import phase_learning_rate
from interleave_model.algorithm.step_guard import StepGuard, check_clipping
from interleave_model.algorithm.supervised import sft_inputs
from interleave_model.evaluation.evaluator import Evaluator, logged_values, prediction_records
from interleave_model.generation.rollout import Rollout
from interleave_model.generation.sampler import Sampler
from interleave_model.legacy import checkpoint_groups, configured_temperature, old_paths, stored_temperature
from interleave_model.model.checkpoint import (
    frozen_weight_keys,
    load_initial_weights,
    restore_run_state,
    save_run_state,
)
from interleave_model.model.policy import (
    as_reference,
    base_from_disk,
    build_policy,
    eval_mode,
    frozen_copy,
    is_peft,
    prepare_for_training,
)
from interleave_model.model.shipped import resolve_model
from interleave_model.preflight.checks import preflight
from interleave_model.runtime.compat import forget_step_values
from interleave_model.runtime.fastest import fastest
from interleave_model.runtime.machine import warn
from interleave_model.settings import (
    GROUPS,
    K1_WARNING,
    TERMS,
    Base,
    DynamicSampling,
    Evaluation,
    Guidance,
    Kl,
    LoraSettings,
    Loss,
    Optimization,
    Sampling,
    TinyModelConfig,
    VllmSettings,
    as_group,
    check_groups,
    typed,
)

# Under manual optimization Lightning warns at every checkpoint that it holds the state after the optimizer step.
# That is the state we want: global_step counts completed steps, and resuming from it is exact (tests/test_resume.py).
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")

# Checkpoints keep these settings in their hyperparameters; torch.load(weights_only=True) must accept them, under
# their paths and under the ones they had before their modules moved into subpackages (legacy.py)
_SETTINGS = (TinyModelConfig, LoraSettings, DynamicSampling, VllmSettings)
torch.serialization.add_safe_globals([*_SETTINGS, *old_paths(_SETTINGS)])


class InterleaveGRPO(L.LightningModule):
    """Policy, frozen reference and GRPO loss for word interleaving.

    Args:
        base: The model trained and how it is loaded: name_or_path (a local HF folder, a shipped model's name, a
            hub name, or "tiny"), dtype, attn_implementation, trust_remote_code, gradient_checkpointing,
            disable_dropout, init_from (`settings.Base`).
        tiny: Shape of the embedded tiny model (used only when `base.name_or_path` is "tiny").
        corpus: Corpus sources whose words form the tiny tokenizer's vocabulary (linked from `data.corpus`).
        template: Prompt template whose words join the tiny vocabulary (linked from `data.template`).
        lora: LoRA settings; None trains all weights.
        seed: Seed of the tiny model's init and of the sampling RNG (offset by rank).
        sampling: How the training rollout samples: num_generations (G), temperature, top_p, top_k, max_new_tokens,
            budget_margin (`settings.Sampling`).
        loss: The clipped policy loss: epsilon, epsilon_high, num_iterations, loss_type, max_completion_length,
            scale_rewards, advantage_estimator (`settings.Loss`).
        kl: The KL term to the reference: beta, estimator (`settings.Kl`); beta 0 skips the reference.
        guidance: CHORD's supervised term on the known answers (`settings.Guidance`); None (default) = off.
        rewards: Reward functions with weights; the alignment score alone by default.
        optimization: learning_rate, sft_learning_rate, weight_decay, warmup_steps, lr_schedule, max_grad_norm,
            micro_batch_size (`settings.Optimization`); the phases are the data's (`phases`).
        dynamic_sampling: Drop zero-variance groups and refill from extra prompts (DAPO); None (default) = off.
        evaluation: How validation, test and predict answer: num_samples, temperature, pass_k, pass_threshold
            (`settings.Evaluation`); `validate --ckpt_path` keeps the command's values, not the checkpoint's.
        rollout_engine: "own" (the project's sampler, `rollout.py`) or "vllm" (colocated vLLM, `vllm_engine.py`),
            used by training, validation, test and predict alike.
        vllm: The vLLM engine's options (memory share, max model length, eager mode, sleep mode).
    """

    def __init__(
        self,
        base: Base = Base(),
        tiny: TinyModelConfig | None = None,
        corpus: list[str] | None = None,
        template: TemplateName = "two_processes",
        lora: LoraSettings | None = None,
        seed: int = 0,
        sampling: Sampling = Sampling(),
        loss: Loss = Loss(),
        kl: Kl = Kl(),
        guidance: Guidance | None = None,
        rewards: list[RewardFunction] | None = None,
        optimization: Optimization = Optimization(),
        dynamic_sampling: DynamicSampling | None = None,
        evaluation: Evaluation = Evaluation(),
        rollout_engine: Literal["own", "vllm"] = "own",
        vllm: VllmSettings | None = None,
    ) -> None:
        super().__init__()
        # fresh copies (the defaults are shared); a checkpoint's are dicts
        base, sampling, loss = as_group(Base, base), as_group(Sampling, sampling), as_group(Loss, loss)
        optimization, evaluation = as_group(Optimization, optimization), as_group(Evaluation, evaluation)
        self.kl, self.guidance = as_group(Kl, kl), typed(Guidance, guidance)
        if self.kl.wasted:
            warn(K1_WARNING)
        self.dynamic_sampling = typed(DynamicSampling, dynamic_sampling)
        check_groups(sampling, loss)
        self.save_hyperparameters(ignore=["rewards"])
        # the settings as typed attributes; hparams (and so checkpoints) keep them as plain dicts, as the CLI gives them
        self.base, self.sampling, self.loss = base, sampling, loss
        self.optimization, self.evaluation = optimization, evaluation
        self.hparams.update({name: asdict(getattr(self, name)) for name in GROUPS})
        self.hparams.update({name: getattr(self, name) and asdict(getattr(self, name)) for name in TERMS})
        # the rollout temperature now, its one stored value: the configured one until the curriculum's
        # raise_temperature response changes it (`CurriculumCallback._apply`, the one place that does); checkpointed
        # here, so a resumed run samples as the interrupted one did, unless its command asks for another
        # (`resumed_temperature`)
        self.temperature = sampling.temperature
        # rows per forward in the update and the supervised steps: the configured value, or with "auto" the fastest
        # here, measured at the first GRPO step (`_fastest_micro_batch`) and checkpointed; one group a forward before
        auto = optimization.micro_batch_size == "auto"
        self.micro_batch_size = sampling.num_generations if auto else optimization.micro_batch_size
        self._micro_batch_measured = not auto
        self.automatic_optimization = False  # a rollout may feed several updates (num_iterations) and bad steps skip
        self.reward_functions = list(rewards) if rewards else [AlignmentReward()]
        # load_from_checkpoint passes these back as the dicts hparams hold
        tiny, lora = typed(TinyModelConfig, tiny) or TinyModelConfig(), typed(LoraSettings, lora)
        # a shipped model's name (`shipped.SHIPPED`) becomes its cached folder; hparams keep the name, so a
        # checkpoint names the model, not this machine's cache
        self.model_path = resolve_model(base.name_or_path)
        self.policy, self.tokenizer, self.stop_ids = build_policy(
            self.model_path, tiny, corpus, template, seed, base.dtype, base.attn_implementation,
            base.trust_remote_code, lora,
        )  # fmt: skip
        if base.init_from is not None:
            load_initial_weights(self.policy, base.init_from)
        prepare_for_training(self.policy, base.disable_dropout, base.gradient_checkpointing)
        # Without LoRA, the reference is a frozen copy of the policy as GRPO starts (after any warm-start).
        self.reference: torch.nn.Module | None = None
        self.evaluator = Evaluator(evaluation, seed)  # validation and test metrics, per length
        self.eval_results: dict | None = None  # the last evaluation's table, for the report writer
        self.guard = StepGuard()  # skips (and counts) the steps a non-finite loss or gradient would spoil
        self._rng: torch.Generator | None = None
        self.sampler = Sampler(
            self.policy, self.tokenizer, self.stop_ids, rollout_engine, sampling, self.model_path, vllm, seed
        )
        # LoRA on a base from disk: checkpoints leave the frozen base out, so loading them is not strict (the keys
        # are checked in on_load_checkpoint instead)
        self.strict_loading = not base_from_disk(self.policy, base.name_or_path)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs) -> InterleaveGRPO:
        """Lightning's `load_from_checkpoint`; a checkpoint written before the settings were grouped loads too.

        Its flat settings (`temperature`, `eval_num_samples`, ...) go into their groups (`legacy.checkpoint_groups`);
        keyword arguments still win.
        """
        return super().load_from_checkpoint(checkpoint_path, *args, **(checkpoint_groups(checkpoint_path) | kwargs))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`; a non-strict load (LoRA on a base from disk) does not report the base's frozen
        weights as missing: they come from its folder, and a LoRA checkpoint leaves them out by design (Lightning
        warns of every missing key it is told of; a missing trainable weight is still told)."""
        keys = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if not strict:
            frozen = frozen_weight_keys(self.policy, prefix="policy.")
            keys.missing_keys[:] = [key for key in keys.missing_keys if key not in frozen]
        return keys

    # ---------------------------------------------------------------- the phases

    @property
    def phases(self):
        """The data's curriculum, the one owner of the phase switch: `sft_steps` warm-start batches, then GRPO from
        `grpo_start` (earlier where `data.curriculum.warm_start_until` ended the warm-start). None outside a fit on
        the InterleaveDataModule (GRPO from the first step)."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return getattr(datamodule, "curriculum", None)

    @property
    def grpo_start(self) -> int:
        """The step GRPO starts at (a warm-start batch is one step): the curriculum's, 0 without one."""
        return 0 if self.phases is None else self.phases.grpo_start

    # ---------------------------------------------------------------- Lightning hooks

    def on_fit_start(self) -> None:
        # from_pretrained returns a model in eval mode; HF's gradient checkpointing (and dropout) act only in train
        # mode. The reference too: it runs its own forwards in eval mode (as_reference), and Lightning warns otherwise.
        self.train()

    def setup(self, stage: str) -> None:
        if stage == "fit":
            check_clipping(self.trainer.strategy, self.optimization.max_grad_norm)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            preflight(self, datamodule, stage)  # bad input is one line now, not after the warm-start

    def configure_optimizers(self):
        params, opt = [p for p in self.policy.parameters() if p.requires_grad], self.optimization
        return torch.optim.AdamW(params, lr=opt.learning_rate, weight_decay=opt.weight_decay)

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        record = None
        if batch["phase"] == "sft":
            stats = self.sft_step(batch)
        else:
            if self.global_step == self.grpo_start:  # the first GRPO batch (a warm-start batch is one step)
                # GRPO starts with fresh AdamW moments, as a run started from the warm start's weights does: the
                # supervised steps' moments would size GRPO's first updates by another loss's gradients
                self.optimizers().optimizer.state.clear()
            trajectory, stats = self.generate_trajectory(batch)
            roll, G = trajectory.rollout, self.sampling.num_generations
            record = StepRecord(batch["prompts"], batch["targets"], batch["n_words"], roll.texts, trajectory.rewards, G)
            if self.dynamic_sampling is not None:
                draw = self.trainer.datamodule.refill_draw(batch["batch_index"], max(batch["n_words"]))  # longest stage
                generate = lambda extra: self.generate_trajectory(move_data_to_device(extra, self.device))[0]  # noqa: E731
                max_rounds, pad = self.dynamic_sampling.max_rounds, self.tokenizer.pad_token_id
                trajectory, counts = refill(trajectory, generate, draw, G, max_rounds, pad)
                stats |= counts
            # every rank holds its final batch now (refill rounds differ)
            if self.loss.scale_rewards == "batch":
                advantages = batch_scaled_advantages(
                    trajectory.rewards, G, self.loss.advantage_estimator, self._sum_over_ranks
                )
                trajectory = trajectory._replace(advantages=advantages)
            for _ in range(self.loss.num_iterations):
                update = self.grpo_step(trajectory, batch)
            stats |= update  # the last update's: its loss, and its learning rate unless it was skipped
        # each value the mean of the ranks' (a std: the mean of their stds), so every rank logs the same
        stats = mean_over_ranks(stats, self._sum_over_ranks, self.device)
        self.log_dict(stats, batch_size=len(batch["targets"]))
        if "train/reward_mean" in stats:
            self.log("reward", stats["train/reward_mean"], prog_bar=True, batch_size=1)
        # replayed rows come last in a batch; its stage is its longest length
        self.log("stage", float(max(batch["n_words"])), prog_bar=True, batch_size=1)
        self._log_step()
        return {"record": record}

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        forget_step_values(self.trainer)  # a step logs what it measured, not what an earlier step did

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        rng, path = self._generator(), self.base.name_or_path
        save_run_state(checkpoint, self.policy, path, rng, self.device, self.guard.skipped)
        checkpoint["temperature"] = self.temperature
        if self.optimization.micro_batch_size == "auto" and self._micro_batch_measured:
            checkpoint["micro_batch_size"] = self.micro_batch_size  # a resumed run takes what was measured

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.temperature = resumed_temperature(checkpoint, self.sampling.temperature)
        if self.optimization.micro_batch_size == "auto" and "micro_batch_size" in checkpoint:
            self.micro_batch_size, self._micro_batch_measured = checkpoint["micro_batch_size"], True
        state = checkpoint, self.policy, self.reference, self._generator, self.device
        self.guard.skipped, self.reference = restore_run_state(*state)
        self.sampler.weights_loaded()

    # ---------------------------------------------------------------- the algorithm

    def generate_trajectory(self, batch: dict) -> tuple[Trajectory, dict[str, float]]:
        """Sample G completions per prompt, score them, and compute advantages and fixed log-probs."""
        sampling, loss = self.sampling, self.loss
        G = sampling.num_generations
        started = time.perf_counter()
        with eval_mode(self.policy):  # the update trains; sampling runs as evaluation does (HF caches only so)
            roll = self._rollout(batch, G, self.temperature, self._generator())
        rolled = time.perf_counter()
        each = lambda values: [v for v in values for _ in range(G)]  # noqa: E731  a prompt's value for each of its G rows
        targets = each(batch["targets"])
        fields = {name: each(batch[name]) for name in FIELDS if name in batch}
        rewards, terms = combine(self.reward_functions, roll.texts, targets, roll.truncated.tolist(), **fields)
        rewards = torch.tensor(rewards, dtype=torch.float32, device=self.device)  # [P*G]
        advantages = grpo.group_advantages(rewards, G, loss.scale_rewards, loss.advantage_estimator)  # [P*G]
        scored = time.perf_counter()

        input_ids = torch.cat([roll.prompt_ids, roll.completion_ids], dim=1)  # [P*G, Lp+C]
        attention_mask = torch.cat([roll.prompt_mask, roll.completion_mask], dim=1)  # [P*G, Lp+C]
        sequences = input_ids, attention_mask, roll.completion_ids
        with torch.no_grad():
            # with one update per rollout the old policy is the current one: grpo_step uses its own detached log-probs
            old = self._logprobs(self.policy, *sequences) if loss.num_iterations > 1 else None
            ref = self._reference_logprobs(*sequences) if self.kl.beta > 0 else None
        fixed = (*sequences, roll.completion_mask, old, ref, rewards, advantages, roll)
        trajectory = Trajectory(*fixed)
        stats = trajectory_stats(trajectory, G) | stream_stats(roll.texts, targets)
        stats |= {"time/rollout_s": rolled - started, "time/reward_s": scored - rolled}
        stats |= {f"train/reward_{name}": sum(v) / len(v) for name, v in terms.items()}
        return trajectory, stats

    def grpo_step(self, trajectory: Trajectory, batch: dict) -> dict[str, float]:
        """One update on a trajectory: the clipped policy loss and the KL term, in micro-batches of rows; then
        guidance's cross-entropy on the known answers, which takes mu of the whole: ``(1 - mu) * GRPO + mu * sft``
        (CHORD)."""
        loss, kl, temperature, G = self.loss, self.kl, self.temperature, self.sampling.num_generations
        if not self._micro_batch_measured:  # `optimization.micro_batch_size: auto`, at the first GRPO step
            self._fastest_micro_batch(trajectory)
        started = time.perf_counter()
        mu = self._guidance_weight()
        grpo_weight = 1.0 - mu
        cap = self.sampler.importance_sampling_cap(trajectory.rollout)  # an engine's samples, corrected: TIS
        mask = trajectory.completion_mask.float()  # [N, C]
        n_rows = mask.shape[0]
        total_tokens = mask.sum().clamp(min=1.0)
        num_tokens = None
        if loss.loss_type == "dapo":  # the tokens of every rank; DDP then averages the ranks' gradients
            num_tokens = self._sum_over_ranks(mask.sum()).clamp(min=1.0).item() / self.trainer.world_size
        max_completion_length = loss.max_completion_length or self.sampling.max_new_tokens
        aggregation = {"loss_type": loss.loss_type, "max_completion_length": max_completion_length,
                       "num_tokens": num_tokens}  # fmt: skip
        totals: dict[str, float] = {"loss": 0.0, "pg_loss": 0.0, "clip_frac": 0.0, "entropy": 0.0}
        if trajectory.ref_logprobs is not None:
            totals["kl"] = 0.0
        engine_logprobs = trajectory.rollout.logprobs  # [N, C], the sampling engine's, when it records them
        if engine_logprobs is not None:  # how far its numerics are from the trainer's (the off-policy gap)
            totals["engine_logprob_gap"] = 0.0
        advantages = trajectory.advantages  # [N]
        optimizer = self.optimizers()
        optimizer.zero_grad()
        for rows in row_chunks(n_rows, self.micro_batch_size):
            ids, attention = trajectory.input_ids[rows], trajectory.attention_mask[rows]
            logprobs, entropy = completion_logprobs(self.policy, ids, attention, trajectory.completion_ids[rows],
                                                    temperature, with_entropy=True, group_size=G)  # fmt: skip
            old = trajectory.old_logprobs[rows] if trajectory.old_logprobs is not None else logprobs.detach()
            weights = None if cap is None else grpo.truncated_importance_weights(old, engine_logprobs[rows], cap)
            out = grpo.policy_loss(logprobs, old, advantages[rows], mask[rows], loss.epsilon, loss.epsilon_high,
                                   importance_weights=weights, **aggregation)  # fmt: skip
            term = out.loss
            # each chunk's share of the whole-batch aggregate: its rows for sequence-level losses ("dapo" divides
            # by the batch's token count already); the per-token statistics are token-weighted whatever the loss type
            token_share = (mask[rows].sum() / total_tokens).item()
            share = 1.0 if loss.loss_type == "dapo" else (rows.stop - rows.start) / n_rows
            if trajectory.ref_logprobs is not None:  # the KL term, on the same log-probs
                penalty = kl_loss(logprobs, trajectory.ref_logprobs[rows], mask[rows], kl.estimator, **aggregation)
                term = term + kl.beta * penalty.loss
                totals["kl"] += penalty.kl.item() * token_share
            self.manual_backward(term * share * grpo_weight)
            totals["loss"] += term.item() * share * grpo_weight
            totals["pg_loss"] += out.loss.item() * share
            entropy = grpo.masked_mean(entropy, mask[rows])
            for key, value in (("clip_frac", out.clip_frac), ("entropy", entropy)):
                totals[key] += value.item() * token_share
            if engine_logprobs is not None:  # `old` is the trainer's log-probs of the weights that sampled
                gap = grpo.masked_mean((old - engine_logprobs[rows]).abs(), mask[rows])
                totals["engine_logprob_gap"] += gap.item() * token_share
        if mu > 0:
            totals["guidance"] = mu
            totals["guidance_loss"] = self._target_backward(batch, mu)
            totals["loss"] += mu * totals["guidance_loss"]
        stats = {f"train/{k}": v for k, v in totals.items()} | self._step_optimizer(totals["loss"], "grpo")
        stats["train/advantage_abs_mean"] = advantages.abs().mean().item()  # [N]: one advantage per completion
        stats["time/update_s"] = time.perf_counter() - started
        return stats

    def sft_step(self, batch: dict) -> dict[str, float]:
        """Supervised warm-start: cross-entropy on the target tokens (and EOS) only."""
        started = time.perf_counter()
        self.optimizers().zero_grad()
        loss = self._target_backward(batch, 1.0)
        stats = {"train/sft_loss": loss} | self._step_optimizer(loss, "sft")
        return stats | {"time/update_s": time.perf_counter() - started}

    # ---------------------------------------------------------------- pieces

    def _guidance_weight(self) -> float:
        """The guidance weight mu at this GRPO step (0 without `model.guidance`)."""
        if self.guidance is None:
            return 0.0
        steps, g = self.global_step - self.grpo_start, self.guidance
        return guidance_weight(steps, g.weight, g.final, g.decay_steps)

    def _fastest_micro_batch(self, trajectory: Trajectory) -> None:
        """`optimization.micro_batch_size: auto`: the update's forward and backward on this step's rows, timed at one
        group a forward, twice that, ... and all rows at once (`runtime.fastest`, the same on every rank); the
        fastest is kept for the run and said in one line. The probe's gradients are dropped: the update that follows
        is the one it would be with that size set."""
        G, n_rows = self.sampling.num_generations, trajectory.input_ids.shape[0]
        sizes = [G * 2**k for k in range(n_rows.bit_length()) if G * 2**k < n_rows] + [None]
        mask = trajectory.completion_mask.float()  # [N, C]

        def update(size: int | None) -> None:
            for rows in row_chunks(n_rows, size):
                ids, attention = trajectory.input_ids[rows], trajectory.attention_mask[rows]
                logprobs, _ = completion_logprobs(self.policy, ids, attention, trajectory.completion_ids[rows],
                                                  self.temperature, with_entropy=True, group_size=G)  # fmt: skip
                self.manual_backward((logprobs * mask[rows]).sum())
            self.optimizers().zero_grad(set_to_none=True)

        chosen, seconds = fastest({size: partial(update, size) for size in sizes}, device=self.device)
        self.micro_batch_size, self._micro_batch_measured = chosen, True
        timed = ", ".join(f"{size or n_rows}: {s:.2f} s" for size, s in seconds.items())
        rank_zero_info(f"model.optimization.micro_batch_size: auto takes {chosen or n_rows} rows a forward, the "
                       f"fastest here (rows a forward: seconds of this step's update; {timed})")  # fmt: skip

    def _target_backward(self, batch: dict, weight: float) -> float:
        """Backward of `weight` times the cross-entropy of the policy on the batch's known answers (the warm start's
        loss, and guidance's term); the loss's value.

        Taken `micro_batch_size` rows at a time, as the update is: each chunk's mean over its target tokens counts by
        its share of the batch's, so the gradient is the whole batch's. All rows at once would hold all their
        activations: 8.3 GB for 16 pairs of SmolLM2 at 10 words, 5.1 GB in chunks of 8.
        """
        input_ids, attention_mask, labels = sft_inputs(self.tokenizer, batch, self.device)  # [B, Lp+T], [B, T]
        counted = labels != -100  # [B, T]
        n_rows, n_tokens = labels.shape[0], counted.sum().clamp(min=1)
        total = 0.0
        for rows in row_chunks(n_rows, self.micro_batch_size):
            logits = completion_logits(self.policy, input_ids[rows], attention_mask[rows], width=labels.shape[1])
            loss = grpo.sft_loss(logits, labels[rows]) * (counted[rows].sum() / n_tokens).item()  # logits [b, T, V]
            self.manual_backward(loss * weight)
            total += loss.item()
        return total

    # Held-out evaluation: the `Evaluator` (a collaborator) draws the answers through the configured engine, scores
    # them per length and tables them; these hooks hand it each batch and log its table.

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluator.update(batch, *self._answers(batch, batch_idx), self.device)

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluator.update(batch, *self._answers(batch, batch_idx), self.device)

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """One record per prompt: the greedy completion, its alignment diagnostics and any sampled answers."""
        return prediction_records(batch, *self._answers(batch, batch_idx))

    def on_validation_epoch_end(self) -> None:
        self._log_table("val")

    def on_test_epoch_end(self) -> None:
        self._log_table("test")

    def greedy(self, batch: dict) -> list[str]:
        """Greedy answers, one per prompt."""
        return self._rollout(batch, num_generations=1, temperature=0.0).texts

    def _answers(self, batch: dict, batch_idx: int) -> tuple[list[str], list[list[str]] | None]:
        """Greedy answers and, with `evaluation.num_samples`, sampled ones (`Evaluator.answers`)."""

        def sample(batch: dict, n: int, temperature: float, generator: torch.Generator | None) -> list[str]:
            return self._rollout(batch, n, temperature, generator).texts

        return self.evaluator.answers(batch, batch_idx, self.global_rank, self.device, sample)

    def _log_table(self, prefix: str) -> None:
        """Log every measure per length and keep the table in `eval_results` (on every rank: all log the same)."""
        rows = self.evaluator.table(self._sum_over_ranks)
        for name, value in logged_values(rows, prefix).items():
            # already equal on every rank; sync_dist (a mean of equal values) only keeps Lightning quiet
            self.log(name, value, batch_size=1, sync_dist=True)
        self._log_step()
        self.eval_results = {"split": prefix, "step": self.global_step, "lengths": rows}

    def _rollout(
        self, batch: dict, num_generations: int, temperature: float, generator: torch.Generator | None = None
    ) -> Rollout:
        # every optimizer step moves global_step, so a new step means new weights for the engine; while training,
        # the update gets the engine's KV memory after sampling, and the own sampler may sample from a merged copy
        version, rank, training = self.global_step, self.global_rank, self.training
        return self.sampler.rollout(batch, num_generations, temperature, generator, version, rank, training)

    def _logprobs(self, model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor):
        temperature, G = self.temperature, self.sampling.num_generations
        size = self.micro_batch_size
        return chunked_completion_logprobs(model, input_ids, attention_mask, completion_ids, temperature, size, G)

    def _reference_logprobs(self, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor) -> Tensor:
        """Log-probs under the reference; without LoRA its frozen copy is taken now, as GRPO starts (after SFT)."""
        if self.reference is None and not is_peft(self.policy):
            rank_zero_info("GRPO starts: freezing a copy of the policy as the KL reference")
            self.reference = frozen_copy(self.policy)
        with as_reference(self.policy, self.reference) as reference:
            return self._logprobs(reference, input_ids, attention_mask, completion_ids)

    def _sum_over_ranks(self, x: Tensor) -> Tensor:
        """The sum of a tensor over all ranks (the tensor itself on one process)."""
        return self.trainer.strategy.reduce(x.clone(), reduce_op="sum")

    def _step_optimizer(self, loss: float, phase: str) -> dict[str, float]:
        """Set the scheduled rate and step; a non-finite loss or gradient norm skips the step (`StepGuard`), which
        still counts. Returns what the step logs: the steps skipped so far, and its learning rate unless it skipped."""
        optimizer, skipped = self.optimizers(), self.guard.skipped
        opt = self.optimization
        lr = phase_learning_rate(
            phase, self.global_step, self.trainer.max_steps, opt.learning_rate, opt.sft_learning_rate,
            opt.warmup_steps, self.phases.sft_steps if self.phases else 0, opt.lr_schedule, self.grpo_start,
        )  # fmt: skip
        for group in optimizer.param_groups:
            group["lr"] = lr
        if not math.isfinite(loss):
            self.guard.skip(optimizer)
        optimizer.step()  # on_before_optimizer_step: skipped there for a non-finite gradient norm, or clipped
        logged = {"train/skipped_steps": float(self.guard.skipped)}
        if self.guard.skipped > skipped:
            return logged
        logged |= {"train/lr": lr, "train/grad_clipped": float(self.guard.clipped)}
        return logged if self.guard.norm is None else logged | {"train/grad_norm": self.guard.norm}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip a step whose loss or gradient norm is not finite on any rank, else clip it (`step_guard.py` says why
        here)."""
        any_rank = lambda local: self.trainer.strategy.reduce_boolean_decision(local, all=False)  # noqa: E731
        self.guard.before_step(optimizer, any_rank, self.optimization.max_grad_norm)

    def _log_step(self) -> None:
        """Have every scalar of this batch (or evaluation) logged at the trainer's `global_step`.

        A logged `step` is the step Lightning hands the loggers; its own count of batches gains one at each resume
        from a checkpoint saved after a validation, and differs from `global_step` whenever a batch makes several
        optimizer steps (`num_iterations`).
        """
        # an evaluation logs once, at its end: the same on every rank, synced only to keep Lightning quiet
        self.log("step", float(self.global_step), batch_size=1, sync_dist=not self.training)

    def _generator(self) -> torch.Generator:
        if self._rng is None or self._rng.device != self.device:
            self._rng = torch.Generator(device=self.device).manual_seed(self.hparams.seed + self.global_rank)
        return self._rng


def resumed_temperature(checkpoint: dict, configured: float) -> float:
    """The rollout temperature a run resumes at: the one it was sampling at (a curriculum may have raised it), unless
    this command configures another `model.sampling.temperature` than the checkpoint's run did: then the user's."""
    stored = stored_temperature(checkpoint)
    if stored is None or configured_temperature(checkpoint) != configured:
        return configured
    return stored

"""The LightningModule: a GRPO step is rollout -> rewards -> advantages -> clipped policy loss, then the auxiliary
terms (KL to the reference, guidance); the supervised warm start is one path beside it."""

from __future__ import annotations

import time
import warnings
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import move_data_to_device, rank_zero_info
from torch import Tensor

from interleave_data.prompts import TemplateName
from interleave_model.algorithm import grpo
from interleave_model.algorithm.completions import chunked_completion_logprobs
from interleave_model.algorithm.dynamic_sampling import refill
from interleave_model.algorithm.loss import GRPOLoss
from interleave_model.algorithm.ranks import mean_over_ranks
from interleave_model.algorithm.records import StepRecord, Trajectory, stream_stats, trajectory_stats
from interleave_model.algorithm.rewards import FIELDS, AlignmentReward, RewardFunction, combine
from interleave_model.algorithm.schedule import Phases, PhaseSchedule
from interleave_model.algorithm.step_guard import StepGuard, check_clipping
from interleave_model.algorithm.update import policy_backward, target_backward
from interleave_model.evaluation.evaluator import Evaluator, monitored_lengths
from interleave_model.evaluation.hooks import HeldOutEvaluation
from interleave_model.generation.rollout import Rollout
from interleave_model.generation.sampler import Sampler
from interleave_model.model.checkpoint import (
    checkpoint_groups,
    frozen_weight_keys,
    load_initial_weights,
    restore_run_state,
    resumed_temperature,
    save_run_state,
)
from interleave_model.model.migrations import migrate
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
from interleave_model.runtime.fastest import fastest_micro_batch
from interleave_model.runtime.machine import warn
from interleave_model.settings.evaluation import Evaluation
from interleave_model.settings.groups import as_hparams, module_groups
from interleave_model.settings.loss import K1_WARNING, Guidance, Kl, Loss
from interleave_model.settings.optimization import Optimization
from interleave_model.settings.policy import Base, LoraSettings, TinyModelConfig
from interleave_model.settings.sampling import DynamicSampling, Sampling, VllmSettings

# Under manual optimization Lightning warns at every checkpoint that it holds the state after the optimizer step.
# That is the state we want: global_step counts completed steps, and resuming from it is exact (tests/test_resume.py).
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


class InterleaveGRPO(HeldOutEvaluation, L.LightningModule):
    """Policy, frozen reference and GRPO loss for word interleaving; held-out evaluation (`HeldOutEvaluation`).

    Args:
        base: The model trained and how it is loaded (`settings.policy.Base`): name_or_path is a local HF folder, a
            shipped model's name, a hub name, or "tiny".
        tiny: Shape of the embedded tiny model (used only when `base.name_or_path` is "tiny").
        corpus: Corpus sources whose words form the tiny tokenizer's vocabulary (linked from `data.corpus`).
        template: Prompt template whose words join the tiny vocabulary (linked from `data.template`).
        lora: LoRA settings; None trains all weights.
        seed: Seed of the tiny model's init and of the sampling RNG (offset by rank).
        sampling: How the training rollout samples (`settings.sampling.Sampling`).
        loss: The clipped policy loss and its advantages (`settings.loss.Loss`).
        kl: The KL term to the reference (`settings.loss.Kl`); beta 0 skips the reference.
        guidance: CHORD's supervised term on the known answers (`settings.loss.Guidance`); None (default) = off.
        rewards: Reward functions with weights; the alignment score alone by default.
        optimization: Rates, schedule, clipping and rows a forward (`settings.optimization.Optimization`); the
            phases are the data's (`phases`).
        dynamic_sampling: Drop zero-variance groups and refill from extra prompts (DAPO); None (default) = off.
        evaluation: How validation, test and predict answer (`settings.evaluation.Evaluation`); `validate --ckpt_path`
            keeps the command's values, not the checkpoint's.
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
        groups = module_groups(
            base=base, tiny=tiny, lora=lora, sampling=sampling, loss=loss, kl=kl, guidance=guidance,
            optimization=optimization, dynamic_sampling=dynamic_sampling, evaluation=evaluation, vllm=vllm,
        )  # fmt: skip
        self.save_hyperparameters(ignore=["rewards"])
        # hparams (and so checkpoints) keep `GROUPS` and `TERMS` as plain dicts, as the CLI gives them, the others as
        # given; the module keeps them as typed attributes
        self.hparams.update(as_hparams(groups))
        base, sampling, loss, optimization = (groups[name] for name in ("base", "sampling", "loss", "optimization"))
        self.base, self.sampling, self.loss, self.optimization = base, sampling, loss, optimization
        self.kl, self.guidance, self.evaluation = groups["kl"], groups["guidance"], groups["evaluation"]
        self.dynamic_sampling = groups["dynamic_sampling"]
        if self.kl.wasted:
            warn(K1_WARNING)
        self.set_temperature(sampling.temperature)
        # rows per forward in the update and the supervised steps: the configured value, or with "auto" the fastest
        # here, measured at the first GRPO step (`_measure_micro_batch`) and checkpointed; one group a forward before
        auto = optimization.micro_batch_size == "auto"
        self.micro_batch_size = sampling.num_generations if auto else optimization.micro_batch_size
        self._micro_batch_measured = not auto
        self.automatic_optimization = False  # a rollout may feed several updates (num_iterations) and bad steps skip
        self.reward_functions = list(rewards) if rewards else [AlignmentReward()]
        tiny, lora, vllm = groups["tiny"] or TinyModelConfig(), groups["lora"], groups["vllm"]
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
        # the clipped policy term, the KL term and their normaliser, called with a micro-batch's tensors
        self.grpo_loss = GRPOLoss.from_settings(loss, self.kl, loss.max_completion_length or sampling.max_new_tokens)
        # Without LoRA, the reference is a frozen copy of the policy as GRPO starts (after any warm-start).
        self.reference: torch.nn.Module | None = None
        self.evaluator = Evaluator(self.evaluation, seed)  # validation and test metrics, per length
        self.guard = StepGuard()  # skips (and counts) the steps a non-finite loss or gradient would spoil
        self._rng: torch.Generator | None = None
        # where the phases lie, as the last training batch carried them (the data's curriculum, the one owner of the
        # phase switch: `sft_steps` warm-start batches, then GRPO from `grpo_start`, earlier where
        # `data.curriculum.warm_start_until` ended the warm start); None before one, or on another loader: GRPO from 0
        self.phases: Phases | None = None
        self.sampler = Sampler(
            self.policy, self.tokenizer, self.stop_ids, rollout_engine, sampling, self.model_path, vllm, seed
        )
        # LoRA on a base from disk: checkpoints leave the frozen base out, so loading them is not strict (the keys
        # are checked in on_load_checkpoint instead)
        self.strict_loading = not base_from_disk(self.policy, base.name_or_path)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs) -> InterleaveGRPO:
        """Lightning's `load_from_checkpoint`; a checkpoint written before the settings were grouped loads too: its
        flat settings go into their groups (`checkpoint.checkpoint_groups`); keyword arguments still win."""
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
    def grpo_start(self) -> int:
        """The step GRPO starts at (a warm-start batch is one step): the curriculum's as the batches carry it, 0
        without one."""
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
            datamodule.watched_lengths = monitored_lengths(self.trainer.callbacks)
            preflight(self, datamodule, stage)  # bad input is one line now, not after the warm-start

    def configure_optimizers(self):
        """AdamW and its schedule (`PhaseSchedule`), which this module steps by hand: a step's rate is set just
        before it, by its batch's phase (`_step_optimizer`)."""
        params, opt = [p for p in self.policy.parameters() if p.requires_grad], self.optimization
        optimizer = torch.optim.AdamW(params, lr=opt.learning_rate, weight_decay=opt.weight_decay)
        schedule = PhaseSchedule(optimizer, opt, self.trainer.max_steps, lambda: self.phases)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        record, self.phases = None, Phases.of(batch)  # the schedule reads them at this step's rate
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
                draw = batch["refill"]  # seeded by the batch's index and the round, at the batch's longest length
                generate = lambda extra: self.generate_trajectory(move_data_to_device(extra, self.device))[0]  # noqa: E731
                max_rounds, pad = self.dynamic_sampling.max_rounds, self.tokenizer.pad_token_id
                trajectory, counts = refill(trajectory, generate, draw, G, max_rounds, pad)
                stats |= counts
            # every rank holds its final batch now (refill rounds differ): its advantages, in one place
            loss = self.loss
            advantages = grpo.group_advantages(trajectory.rewards, G, loss.scale_rewards, loss.advantage_estimator,
                                               sum_over_ranks=self._sum_over_ranks)  # fmt: skip
            trajectory = trajectory._replace(advantages=advantages)  # [P*G]
            if not self._micro_batch_measured:  # `optimization.micro_batch_size: auto`, at the first GRPO step
                self._measure_micro_batch(trajectory)
            for _ in range(loss.num_iterations):
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
        # first: Lightning restores the DataModule's and the callbacks' entries after this hook, in today's layout
        migrate(checkpoint)
        self.set_temperature(resumed_temperature(checkpoint, self.sampling.temperature))
        if self.optimization.micro_batch_size == "auto" and "micro_batch_size" in checkpoint:
            self.micro_batch_size, self._micro_batch_measured = checkpoint["micro_batch_size"], True
        state = checkpoint, self.policy, self.reference, self._generator, self.device
        self.guard.skipped, self.reference = restore_run_state(*state)
        self.sampler.weights_loaded()

    @property
    def temperature(self) -> float:
        """The rollout temperature now (and the log-probs'), set by `set_temperature` alone."""
        return self._temperature

    def set_temperature(self, temperature: float) -> None:
        """The one place the rollout temperature is set: the configured one at the start, the one a resumed run was
        sampling at (`resumed_temperature`), a curriculum's raise (`CurriculumCallback`). Checkpointed
        (`on_save_checkpoint`), so a resumed run samples as the interrupted one did."""
        self._temperature = temperature

    # ---------------------------------------------------------------- the algorithm

    def generate_trajectory(self, batch: dict) -> tuple[Trajectory, dict[str, float]]:
        """Sample G completions per prompt, score them, and take the log-probs the update holds fixed (the old
        policy's, the reference's); the advantages are the step's, made after any refill (`training_step`)."""
        G, started = self.sampling.num_generations, time.perf_counter()
        with eval_mode(self.policy):  # the update trains; sampling runs as evaluation does (HF caches only so)
            roll = self._rollout(batch, G, self.temperature, self._generator())
        rolled = time.perf_counter()
        each = lambda values: [v for v in values for _ in range(G)]  # noqa: E731  a prompt's value for each of its G rows
        targets = each(batch["targets"])
        fields = {name: each(batch[name]) for name in FIELDS if name in batch}
        rewards, terms = combine(self.reward_functions, roll.texts, targets, roll.truncated.tolist(), **fields)
        rewards = torch.tensor(rewards, dtype=torch.float32, device=self.device)  # [P*G]
        scored = time.perf_counter()

        input_ids = torch.cat([roll.prompt_ids, roll.completion_ids], dim=1)  # [P*G, Lp+C]
        attention_mask = torch.cat([roll.prompt_mask, roll.completion_mask], dim=1)  # [P*G, Lp+C]
        sequences = input_ids, attention_mask, roll.completion_ids
        with torch.no_grad():
            # with one update per rollout the old policy is the current one: grpo_step uses its own detached log-probs
            old = self._logprobs(self.policy, *sequences) if self.loss.num_iterations > 1 else None
            ref = self._reference_logprobs(*sequences) if self.kl.beta > 0 else None
        trajectory = Trajectory(*sequences, roll.completion_mask, old, ref, rewards, None, roll)
        stats = trajectory_stats(trajectory, G) | stream_stats(roll.texts, targets)
        stats |= {"time/rollout_s": rolled - started, "time/reward_s": scored - rolled}
        stats |= {f"train/reward_{name}": sum(v) / len(v) for name, v in terms.items()}
        return trajectory, stats

    def grpo_step(self, trajectory: Trajectory, batch: dict) -> dict[str, float]:
        """One update on a trajectory with its advantages: the clipped policy loss and the KL term; then guidance's
        cross-entropy on the known answers, which takes mu of the whole: ``(1 - mu) * GRPO + mu * sft`` (CHORD)."""
        started = time.perf_counter()
        mu = 0.0 if self.guidance is None else self.guidance.weight
        self.optimizers().zero_grad()
        totals = self._policy_backward(trajectory, self.micro_batch_size, 1.0 - mu)
        if mu > 0:
            totals["guidance"], totals["guidance_loss"] = mu, self._target_backward(batch, mu)
            totals["loss"] += mu * totals["guidance_loss"]
        stats = {f"train/{k}": v for k, v in totals.items()} | self._step_optimizer(totals["loss"], "grpo")
        stats["train/advantage_abs_mean"] = trajectory.advantages.abs().mean().item()  # one advantage a completion
        return stats | {"time/update_s": time.perf_counter() - started}

    def sft_step(self, batch: dict) -> dict[str, float]:
        """Supervised warm-start: cross-entropy on the target tokens (and EOS) only."""
        started = time.perf_counter()
        self.optimizers().zero_grad()
        loss = self._target_backward(batch, 1.0)
        stats = {"train/sft_loss": loss} | self._step_optimizer(loss, "sft")
        return stats | {"time/update_s": time.perf_counter() - started}

    # ---------------------------------------------------------------- pieces

    def _policy_backward(self, trajectory: Trajectory, micro_batch_size: int | None, weight: float) -> dict:
        """`update.policy_backward` of this run's loss; "dapo" counts the tokens of every rank (DDP then averages the
        ranks' gradients)."""
        num_tokens = None
        if self.grpo_loss.loss_type == "dapo":
            tokens = self._sum_over_ranks(trajectory.completion_mask.sum().float())
            num_tokens = tokens.clamp(min=1.0).item() / self.trainer.world_size
        return policy_backward(
            self.policy, trajectory, self.grpo_loss, self.manual_backward, temperature=self.temperature,
            num_generations=self.sampling.num_generations, micro_batch_size=micro_batch_size, weight=weight,
            num_tokens=num_tokens,
            importance_cap=self.sampler.importance_sampling_cap(trajectory.rollout),  # an engine's samples: TIS
        )  # fmt: skip

    def _measure_micro_batch(self, trajectory: Trajectory) -> None:
        """`optimization.micro_batch_size: auto`: this step's update timed at each size (`fastest_micro_batch`, the
        same on every rank), the fastest kept for the run and said in one line. The probe's gradients are dropped:
        the update that follows is the one it would be with that size set."""

        def update(size: int | None) -> None:
            self._policy_backward(trajectory, size, 1.0)
            self.optimizers().zero_grad(set_to_none=True)

        n_rows = trajectory.input_ids.shape[0]
        chosen, line = fastest_micro_batch(update, self.sampling.num_generations, n_rows, self.device)
        self.micro_batch_size, self._micro_batch_measured = chosen, True
        rank_zero_info(line)

    def _target_backward(self, batch: dict, weight: float) -> float:
        """`update.target_backward`: the warm start's loss, and guidance's term."""
        return target_backward(self.policy, self.tokenizer, batch, self.device, self.micro_batch_size,
                               self.manual_backward, weight)  # fmt: skip

    def _rollout(
        self, batch: dict, num_generations: int, temperature: float, generator: torch.Generator | None = None
    ) -> Rollout:
        # every optimizer step moves global_step, so a new step means new weights for the engine; while training,
        # the update gets the engine's KV memory after sampling, and the own sampler may sample from a merged copy
        version, rank, training = self.global_step, self.global_rank, self.training
        return self.sampler.rollout(batch, num_generations, temperature, generator, version, rank, training)

    def _logprobs(self, model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor):
        args = self.temperature, self.micro_batch_size, self.sampling.num_generations
        return chunked_completion_logprobs(model, input_ids, attention_mask, completion_ids, *args)

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
        """Step at the scheduled rate; a non-finite loss or gradient norm skips the step, which still counts
        (`StepGuard.step`, what it logs)."""
        schedule = self.lr_schedulers()
        if schedule is not None:  # an optimizer a subclass configures without a schedule keeps its own rate
            schedule.at(phase, self.global_step)
        return self.guard.step(self.optimizers(), loss)

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

"""The records a GRPO step passes on: the trajectory the update trains on, and what callbacks see of the step."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from interleave_model.algorithm import grpo
from interleave_model.evaluation.metric import AlignmentScore
from interleave_model.generation.rollout import Rollout


class Trajectory(NamedTuple):
    """Everything the update needs from one rollout, group-major over P prompts x G completions."""

    input_ids: Tensor  # [P*G, Lp+C] prompt then completion
    attention_mask: Tensor  # [P*G, Lp+C]
    completion_ids: Tensor  # [P*G, C]
    completion_mask: Tensor  # [P*G, C]
    old_logprobs: Tensor | None  # [P*G, C], None when num_iterations == 1 (then old = current, detached)
    ref_logprobs: Tensor | None  # [P*G, C], None when beta == 0
    rewards: Tensor  # [P*G]
    advantages: Tensor | None  # [P*G] one per completion: the step's, made after any refill (None before)
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


def trajectory_stats(trajectory: Trajectory, num_generations: int) -> dict[str, float]:
    """What a step logs of its rollout: the rewards and their spread, the completions' lengths.

    The advantages are logged by the update that uses them (`InterleaveGRPO.grpo_step`): they are made after any
    dynamic-sampling refill.
    """
    rewards, roll = trajectory.rewards, trajectory.rollout  # [P*G]
    zero_std = grpo.zero_std_groups(rewards, num_generations)  # [P]
    return {
        "train/reward_mean": rewards.mean().item(),
        "train/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "train/frac_zero_std_groups": zero_std.float().mean().item(),
        "train/completion_len": roll.completion_mask.sum(-1).float().mean().item(),
        "train/truncated_frac": roll.truncated.float().mean().item(),
    }


def stream_stats(completions: list[str], targets: list[str]) -> dict[str, float]:
    """How the sampled completions hold the two streams, whatever the reward pays for: A and B accuracy, answer
    length over target length and the share that copies one fragment (`AlignmentScore`, as held-out answers get)."""
    metric = AlignmentScore(sync_on_compute=False)
    metric.update(completions, targets)
    values = metric.compute_all()
    return {f"train/{name}": values[name].item() for name in ("a_accuracy", "b_accuracy", "length_ratio", "copy_share")}

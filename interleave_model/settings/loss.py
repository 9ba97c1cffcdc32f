"""GRPO's clipped policy loss and its advantages (`model.loss`) and the auxiliary terms of the loss (`model.kl`,
`model.guidance`); TRL's names where TRL has the knob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from interleave_model.settings import SettingsError

# The string choices, as types: a config naming another value is refused when it is parsed, before any step runs.
KlEstimator = Literal["k1", "k2", "k3"]
LossType = Literal["grpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
AdvantageEstimator = Literal["grpo", "rloo"]


@dataclass
class Loss:
    """The clipped policy loss of GRPO (`model.loss`); the auxiliary terms have their own groups (`Kl`, `Guidance`).

    Args:
        epsilon: Lower clip of the ratio (1 - epsilon).
        epsilon_high: Upper clip (1 + epsilon_high), DAPO's "clip-higher" (Yu et al., arXiv 2503.14476); None means
            epsilon.
        num_iterations: Updates per rollout (mu); above 1 the old log-probs are computed once and reused.
        loss_type: "grpo" (sequence mean, Shao et al., arXiv 2402.03300), "dr_grpo" (constant normaliser, Liu et al.,
            arXiv 2503.20783) or "dapo" (token level: the tokens of all ranks, arXiv 2503.14476); TRL's names.
        max_completion_length: The constant length of "dr_grpo"'s normaliser, token sum / (N * this) (TRL's name);
            None means `sampling.max_new_tokens`. "dr_grpo" needs one of the two: a normaliser taken from the batch's
            longest completion would reweight every token by how long its batch happened to run.
        scale_rewards: "group", "batch" (the reward std of all ranks) or "none" (Dr. GRPO); TRL's.
        advantage_estimator: "grpo" (group mean baseline) or "rloo" (leave-one-out; Ahmadian et al., arXiv
            2402.14740, TRL's RLOO trainer).
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    loss_type: LossType = "grpo"
    max_completion_length: int | None = None
    scale_rewards: ScaleRewards = "group"
    advantage_estimator: AdvantageEstimator = "grpo"

    def __post_init__(self) -> None:
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise SettingsError(f"model.loss.max_completion_length must be >= 1, got {self.max_completion_length}")
        if self.num_iterations < 1:
            raise SettingsError(f"model.loss.num_iterations must be >= 1, got {self.num_iterations}")


@dataclass
class Kl:
    """The KL term to the frozen reference (`model.kl`, `algorithm/kl.py`): `beta` times the KL estimate of each
    completion token, aggregated as the policy loss aggregates its tokens (TRL's `beta`).

    Args:
        beta: The coefficient; 0 (TRL's default) skips the reference's forward entirely. The 3B configs set 0.04,
            DeepSeekMath's GRPO value (Shao et al., arXiv 2402.03300).
        estimator: "k1", "k2" or "k3" (`kl.kl_divergence`). As a loss term k1's expected gradient is zero, so
            `beta > 0` with k1 warns (`K1_WARNING`) when the module is built.
    """

    beta: float = 0.0
    estimator: KlEstimator = "k3"

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise SettingsError(f"model.kl.beta must be >= 0, got {self.beta}")

    @property
    def wasted(self) -> bool:
        """True where beta > 0 buys nothing: as a loss term, k1's expected gradient is zero."""
        return self.beta > 0 and self.estimator == "k1"


K1_WARNING = (
    "model.kl.estimator: k1 has zero expected gradient as a loss term, so beta > 0 regularises nothing; use k3 (or k2)"
)


@dataclass
class Guidance:
    """Reference guidance (`model.guidance`): every prompt of this task has its answer, so the loss can learn from it
    beside the group's samples, ``(1 - mu) * GRPO + mu *`` the warm start's cross-entropy on the known targets
    (CHORD-mu: Zhang et al. 2025, arXiv 2508.11408, with a constant mu). Null (the default) is pure GRPO, with no
    target token in any gradient.

    Args:
        weight: mu, in (0, 1].
    """

    weight: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise SettingsError(f"model.guidance.weight must be in (0, 1] (null turns guidance off), got {self.weight}")

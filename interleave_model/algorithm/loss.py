"""The GRPO loss as one object built from the settings (`model.loss`, `model.kl`), called with named tensors, as
torchtune's `GRPOLoss`: the clipped policy term (`grpo.policy_loss`) plus beta times the KL term (`kl.kl_loss`), both
aggregated by the same token normaliser (`grpo.aggregate`). The math stays in those pure functions; this wires them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from interleave_model.algorithm import grpo
from interleave_model.algorithm.kl import KlOutput, kl_loss
from interleave_model.settings.loss import Kl, KlEstimator, Loss, LossType


class GRPOTerms(NamedTuple):
    """A micro-batch's loss: ``loss`` (differentiable, ``policy.loss + beta * kl.loss``), the policy term with its
    diagnostics, and the KL term (None without reference log-probs)."""

    loss: Tensor
    policy: grpo.LossOutput
    kl: KlOutput | None


@dataclass(frozen=True)
class GRPOLoss:
    """The clipped policy term plus ``beta`` times the KL term, with their token normaliser.

    Attributes:
        epsilon, epsilon_high: The clip band of the ratio (`Loss`).
        beta, kl_estimator: The KL term's coefficient and estimator (`Kl`).
        loss_type, max_completion_length: The token normaliser (`grpo.aggregate`); `max_completion_length` is the
            constant of "dr_grpo"'s.
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    kl_estimator: KlEstimator = "k3"
    loss_type: LossType = "grpo"
    max_completion_length: int | None = None

    @classmethod
    def from_settings(cls, loss: Loss, kl: Kl, max_completion_length: int | None) -> GRPOLoss:
        """The loss of `model.loss` and `model.kl`; `max_completion_length` is `loss.max_completion_length` or the
        sampling's `max_new_tokens`, the caller's choice."""
        return cls(loss.epsilon, loss.epsilon_high, kl.beta, kl.estimator, loss.loss_type, max_completion_length)

    def __call__(
        self,
        *,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logprobs: Tensor | None = None,
        importance_weights: Tensor | None = None,
        num_tokens: float | None = None,
    ) -> GRPOTerms:
        """The loss of a micro-batch of completions.

        Args:
            logprobs: ``[N, L]`` the completion tokens' log-probs under the policy (with grad).
            old_logprobs: ``[N, L]`` under the policy that sampled them (``logprobs.detach()`` on a first pass).
            advantages: ``[N]`` one a completion.
            mask: ``[N, L]`` the completion tokens that count.
            ref_logprobs: ``[N, L]`` under the reference; None leaves the KL term out.
            importance_weights: ``[N, L]`` weights of the policy term's tokens (TIS); None = 1.
            num_tokens: "dapo"'s normaliser where the tokens of every rank count (`grpo.aggregate`).
        """
        normaliser = {"loss_type": self.loss_type, "max_completion_length": self.max_completion_length,
                      "num_tokens": num_tokens}  # fmt: skip
        policy = grpo.policy_loss(logprobs, old_logprobs, advantages, mask, self.epsilon, self.epsilon_high,
                                  importance_weights=importance_weights, **normaliser)  # fmt: skip
        if ref_logprobs is None:
            return GRPOTerms(policy.loss, policy, None)
        penalty = kl_loss(logprobs, ref_logprobs, mask, self.kl_estimator, **normaliser)
        return GRPOTerms(policy.loss + self.beta * penalty.loss, policy, penalty)

    def share(self, rows: slice, n_rows: int) -> float:
        """The share of the whole batch's loss that a micro-batch of `rows` (of `n_rows`) carries: its rows for the
        sequence-level normalisers; 1 for "dapo", whose normaliser is the batch's token count already."""
        return 1.0 if self.loss_type == "dapo" else (rows.stop - rows.start) / n_rows

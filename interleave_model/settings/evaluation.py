"""How validation, test and predict answer (`model.evaluation`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from interleave_model.settings import SettingsError


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

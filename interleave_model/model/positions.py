"""Position ids: the usual ones that skip left padding, or the embedded model's coupled ones.

Sampling and scoring must use the same positions, or the policy's log-probs drift from the sampler's: every forward
of the project (the own sampler's prefill and decode, speculation, the update's log-probs, the warm start) takes its
positions from `model_positions`.

Coupled positions (Cho et al. 2024, "Position Coupling", arXiv 2405.20671) give each answer word the position of the
source word it copies. On the compact prompt `A: a1 .. aN B: b1 .. bN Interleave:` of a word-level tokenizer::

    A: 1   a_i 2i   B: 2N+2   b_i 2i+1   Interleave: 1   answer word k: k+1

so a_i and b_i sit at the positions 2i and 2i+1 of their turn in the answer, and the word to write next is always the
source word one position ahead of the last token: `Interleave:` (1) is followed by a1 (2), answer word k by the
source word at k+2, and the last answer word (2N+1) by EOS, since `B:` holds 2N+2. The rule is the same at every N,
which is what lets a model trained on short pairs carry it to longer ones (docs/RESULTS.md, "Length generalisation").
Only the own sampler knows these positions: vLLM and `generate` number tokens 0, 1, 2, ... (`refuse_coupled`).
"""

from __future__ import annotations

import torch
from torch import Tensor

COUPLED = "interleave"  # `config.position_coupling` of a model trained on coupled positions
COUPLING_MARKERS = ("A:", "B:", "Interleave:")  # the compact prompt's words around its 2N fragment words
PROMPT_MARKERS = len(COUPLING_MARKERS)


class CoupledPositionsError(ValueError):
    """A runtime that numbers tokens 0, 1, 2, ... asked to run a model trained on coupled positions, or a prompt
    coupled positions cannot number."""


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: the first real token of each row is 0. [N, L] -> [N, L]."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def is_coupled(model_or_config) -> bool:
    """Whether a model (a peft wrapper, a decoder or a merged copy alike) or its config declares coupled positions."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "position_coupling", None) == COUPLED


def model_positions(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_length: int | None = None
) -> Tensor:
    """The positions `model` runs the rows of `input_ids` at: [N, L].

    Args:
        input_ids: [N, L], a left-padded prompt in its first `prompt_length` columns, then the answer.
        attention_mask: [N, L], 1 for real tokens.
        prompt_length: Columns of the prompt; None means the whole row is prompt.
    """
    if not is_coupled(model):
        return position_ids(attention_mask)
    length = attention_mask.shape[1] if prompt_length is None else prompt_length
    return coupled_positions(attention_mask, length, input_ids, getattr(model.config, "coupling_markers", None))


def coupled_positions(
    attention_mask: Tensor, prompt_length: int, input_ids: Tensor | None = None, markers: list[int] | None = None
) -> Tensor:
    """Coupled positions (module docstring) of compact prompts in the first `prompt_length` columns and their answers
    after them: [N, L] -> [N, L]. A prompt of 2N + 3 tokens has no BOS; one of 2N + 4 starts with it (position 0).
    Padding gets the position of the token before it (0 for left padding).

    Args:
        markers: The ids of `A:`, `B:` and `Interleave:` (`config.coupling_markers`); with `input_ids`, a prompt
            whose markers are not where its length puts them (text after `Interleave:`, another template) is refused.

    Raises:
        CoupledPositionsError: A prompt that is not `[<s>] A: a1 .. aN B: b1 .. bN Interleave:`, one token each.
    """
    prompt_tokens = attention_mask[:, :prompt_length].sum(-1, keepdim=True)  # [N, 1]
    bos = (prompt_tokens % 2 == 0).long()  # [N, 1] 2N + 4 tokens: a BOS first
    n = (prompt_tokens - PROMPT_MARKERS - bos) // 2  # [N, 1] words per fragment
    if bool((n < 1).any()):
        raise CoupledPositionsError(
            "coupled positions need the compact template and a word-level tokenizer (a prompt of 2N + 3 tokens: "
            "A: a1 .. aN B: b1 .. bN Interleave:); set data.template: compact with the embedded tiny model"
        )
    q = attention_mask.cumsum(-1) - 1 - bos  # [N, L] the token's index in its row: BOS -1, left padding below
    if markers is not None and input_ids is not None:
        _check_markers(
            input_ids[:, :prompt_length], attention_mask[:, :prompt_length], q[:, :prompt_length], n, markers
        )
    coupled = torch.where(q == 0, 1, 0)  # BOS 0, A: 1
    coupled = torch.where((q >= 1) & (q <= n), 2 * q, coupled)  # a_i (i = q) at 2i
    coupled = torch.where(q == n + 1, 2 * n + 2, coupled)  # B:
    coupled = torch.where((q >= n + 2) & (q <= 2 * n + 1), 2 * (q - n - 1) + 1, coupled)  # b_i (i = q - n - 1)
    coupled = torch.where(q == 2 * n + 2, 1, coupled)  # Interleave:
    return torch.where(q >= 2 * n + 3, q - 2 * n - 1, coupled)  # answer word k (k = q - 2n - 2) at k + 1


def _check_markers(prompt_ids: Tensor, prompt_mask: Tensor, q: Tensor, n: Tensor, markers: list[int]) -> None:
    """Refuse prompts whose `A:`, `B:` and `Interleave:` are not at the indices 0, N + 1 and 2N + 2 (all [P, Lp])."""
    a, b, interleave = markers
    expected = torch.where(q == 0, a, torch.where(q == n + 1, b, torch.where(q == 2 * n + 2, interleave, -1)))
    if bool(((expected >= 0) & (prompt_mask == 1) & (prompt_ids != expected)).any()):
        raise CoupledPositionsError(
            "coupled positions number prompts of the compact template alone (A: a1 .. aN B: b1 .. bN Interleave:), "
            "and a prompt has its markers elsewhere (text after `Interleave:`, another template): "
            "set data.template: compact"
        )


def refuse_coupled(model_or_config, runtime: str) -> None:
    """Refuse, in one line, to run a coupled model where positions cannot be passed (vLLM, `generate`, lm-eval)."""
    if is_coupled(model_or_config):
        raise CoupledPositionsError(
            f"{runtime} numbers tokens 0, 1, 2, ... and cannot run a model trained on coupled positions "
            "(config.position_coupling); run it with the own sampler: cli.py test / validate, model.rollout_engine: own"
        )

"""Per-word credit: each word of an answer gets its own advantage, from the group's answers at the same state.

Sequence-level GRPO gives every token of a completion the completion's advantage. An answer that interleaves five
pairs and then copies fragment A is paid for its copying tokens as much as for its first ten words, and one that goes
wrong at word 3 is charged for its correct first words. On this task each word is a decision with a known right
answer: the target's next word (or, after the last, the stop). This is GRPO's process supervision (DeepSeekMath,
arXiv 2402.03300, section 4.1.3: a reward per step, normalised within the group) with the word as the step, and with
one property of the task used for the baseline: every answer of a group that is correct up to word j is in the same
state (the same prompt, the same words), so the share of them that get word j right is a Monte-Carlo value of that
state, measured by the group itself.

Per completion, ``k`` is its first wrong decision (`first_wrong_decision`): the length of its common word prefix with
the target, or ``n_target + 1`` for the exact answer (its stop is right too). Word ``j``'s tokens get

    advantage = [k > j] - p_j,    p_j = mean of [k' > j] over the group's completions with k' >= j

for ``j <= k``. A word every completion of the group gets right, or one only this completion reached, gets 0. Words
after ``k`` are off the target's path: they get the completion's own sequence advantage (GRPO's, from the reward),
so the rest of an answer is still judged as a whole. Given no credit at all there, they drift: on SmolLM2 (seed 1,
33 steps) answers grew to 1.27 times the target's length and the held-out score fell from 0.522 to 0.424. Tokens
belong to the word their first non-space character starts or continues; whitespace, a stop token and other special
tokens belong to the next word (the stop is the decision after the last word).

Only the policy's own tokens are in the gradient: no target token is (pure GRPO). The sequence reward is still
computed and logged, and the held-out metric is the alignment score.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from interleave_model.evaluation.alignment import align_batch
from interleave_model.generation.rollout import Rollout

# tokens decoded before a token to find its text: enough for a byte-level BPE's multi-byte characters and for
# SentencePiece's leading-space rule (both strip or merge at a window's start, the same way with or without the token)
WINDOW = 4


def token_word_index(
    tokenizer, completion_ids: Tensor, completion_mask: Tensor, stop_ids: Sequence[int], texts: Sequence[str]
) -> Tensor:
    """The word (0-based, in whitespace words of the completion) each completion token writes: [N, C] long, -1
    outside the mask. Whitespace-only and stop tokens belong to the next word.

    A row whose tokens, decoded one at a time, do not give back its text's words (`texts`, as the reward read them)
    gets -1 everywhere: no credit rather than credit on the wrong words.
    """
    out = torch.full(completion_ids.shape, -1, dtype=torch.long)
    stops = set(stop_ids)
    rows = zip(completion_ids.tolist(), completion_mask.bool().tolist(), texts, strict=True)
    for row, (ids, keep, expected) in enumerate(rows):
        text, index = "", []
        for t, token in enumerate(ids):
            if not keep[t]:
                index.append(-1)
                continue
            piece = " " if token in stops else _piece(tokenizer, ids, t)
            text += piece
            n_words = len(text.split())
            index.append(n_words - 1 if piece.strip() else n_words)
        if text.split() == expected.split():
            out[row] = torch.tensor(index)
    return out.to(completion_ids.device)


def _piece(tokenizer, ids: list[int], t: int) -> str:
    """Token t's text as it reads after the tokens before it (a leading space included)."""
    start = max(0, t - WINDOW)
    decoded = [
        tokenizer.decode(ids[start:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for end in (t, t + 1)
    ]
    before, after = decoded
    return after[len(before) :] if after.startswith(before) else after


def first_wrong_decision(completions: Sequence[str], targets: Sequence[str]) -> list[int]:
    """Per completion, the index of its first wrong decision: the length of its common word prefix with the target
    (`Alignment.first_error`), or ``n_target + 1`` when it is the target exactly (every word and the stop right)."""
    return [
        a.n_target + 1 if a.first_error == a.n_target == a.n_pred else a.first_error
        for a in align_batch(completions, targets)
    ]


def word_advantages(word_index: Tensor, first_wrong: Tensor, num_generations: int, sequence: Tensor) -> Tensor:
    """Per-token advantages ``[k > j] - p_j`` on each completion's words ``j <= k``, its sequence advantage after
    ``k``, 0 outside the mask. [N, C] float32.

    Args:
        word_index: ``[N, C]`` the word each token writes (`token_word_index`), -1 outside the mask.
        first_wrong: ``[N]`` each completion's first wrong decision (`first_wrong_decision`).
        num_generations: ``G``; rows are group-major.
        sequence: ``[N]`` the completions' sequence advantages (`grpo.group_advantages`).
    """
    n, _ = word_index.shape
    if n % num_generations:
        raise ValueError(f"{n} rows do not split into groups of num_generations={num_generations}")
    k = first_wrong.to(word_index.device).long()  # [N]
    n_positions = int(max(word_index.max().item(), k.max().item())) + 2
    positions = torch.arange(n_positions, device=word_index.device)  # [J]
    reached = k[:, None] >= positions  # [N, J] completion reached position j on the target's path
    right = k[:, None] > positions  # [N, J] and got it right
    grouped = lambda x: x.view(-1, num_generations, n_positions).float()  # noqa: E731  [P, G, J]
    p = grouped(right).sum(1) / grouped(reached).sum(1).clamp(min=1)  # [P, J] value of the state at j
    per_position = right.float() - p.repeat_interleave(num_generations, dim=0)  # [N, J]
    after = sequence.to(per_position)[:, None].expand_as(per_position)  # [N, J]
    per_position = torch.where(reached, per_position, after)  # past k: the answer's own advantage
    index = word_index.clamp(min=0)  # [N, C]
    advantages = per_position.gather(1, index)  # [N, C]
    return torch.where(word_index >= 0, advantages, torch.zeros_like(advantages))  # [N, C]


def word_credit(
    tokenizer,
    rollout: Rollout,
    targets: Sequence[str],
    stop_ids: Sequence[int],
    num_generations: int,
    sequence: Tensor,
) -> tuple[Tensor, float]:
    """A rollout's per-token advantages ([N, C]) from its `sequence` advantages ([N]), and the share of its
    completions left without credit because their tokens, decoded one at a time, did not give back their text
    (`token_word_index`)."""
    words = token_word_index(tokenizer, rollout.completion_ids, rollout.completion_mask, stop_ids, rollout.texts)
    first_wrong = torch.tensor(first_wrong_decision(rollout.texts, targets))  # [N]
    written = rollout.completion_mask.bool().any(1)  # [N] rows with at least one token
    unmatched = ((words < 0).all(1) & written).float().mean().item()
    return word_advantages(words, first_wrong, num_generations, sequence), unmatched

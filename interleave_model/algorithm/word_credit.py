"""Per-word credit: each word of an answer gets its own advantage, from the group's answers at the same state.

Sequence-level GRPO gives every token of a completion the completion's advantage. An answer that interleaves five
pairs and then copies fragment A is paid for its copying tokens as much as for its first ten words, and one that goes
wrong at word 3 is charged for its correct first words. On this task each word is a decision with a known right
answer: the target's next word (or, after the last, the stop). This is GRPO's process supervision (DeepSeekMath,
arXiv 2402.03300, section 4.1.3: a reward per step, normalised within the group) with the word as the step, and with
one property of the task used for the baseline: every answer of a group that is correct up to word j is in the same
state (the same prompt, the same words), so the share of them that get word j right is a Monte-Carlo value of that
state, measured by the group itself.

Three ways to say which decisions a completion made (`model.loss.credit`):

- ``word`` (`prefix_decisions`): the decisions on the target's path. ``k`` is the completion's first wrong decision:
  the length of its common word prefix with the target (the exact answer's stop is right too). Its words ``j < k`` are
  right, word ``k`` is wrong, and every answer of the group that reached ``j`` was in the same state. Words after
  ``k`` are off the path: they get the completion's own sequence advantage (GRPO's, from the reward), so the rest of
  an answer is still judged as a whole. Given no credit at all there, they drift: on SmolLM2 (seed 1, 33 steps)
  answers grew to 1.27 times the target's length and the held-out score fell from 0.522 to 0.424.
- ``position`` (`position_decisions`): every word ``j`` of a completion against the target's word ``j``, and its stop
  against the target's length. After a wrong word the states differ between answers, so ``p_j`` is a baseline per
  position rather than per state; it still depends on no answer's own action. Nothing is paid for copying one
  fragment (its words sit at the wrong positions from the second on), a wrong word costs that word, and an answer
  that runs past the target is charged for the first word it writes instead of stopping.
- ``pair`` (`pair_decisions`): as ``position``, with the two words of each pair (``a_i b_i``) right only together.
  Under ``position`` SmolLM2 learned to write fragment A's words at their positions and to fill B's slots with A's
  words again (seed 0: A 0.56 -> 0.87 and B 0.69 -> 0.31 of the held-out words in place, in 33 steps): each A word was
  paid on its own. Here a pair is paid only when its B word is right too.

Word ``j``'s tokens get ``right - p_j`` where the completion made decision ``j``, ``p_j`` the share of the group's
decisions at ``j`` that are right; a decision every answer gets right (or wrong) gets 0. Tokens belong to the word
their first non-space character starts or continues; whitespace, a stop token and other special tokens belong to
the next word (the stop is the decision after the last word).

Only the policy's own tokens are in the gradient: no target token is (pure GRPO). The sequence reward is still
computed and logged, and the held-out metric is the alignment score.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
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


def prefix_decisions(completions: Sequence[str], targets: Sequence[str]) -> Tensor:
    """``credit: word``: each completion's decisions on the target's path, [N, J] int8: 1 for the words of its common
    word prefix with the target (`Alignment.first_error`), then 0 for its first wrong decision, then -1 (off the path:
    no decision of its own, the completion's sequence advantage there). The exact answer's stop is right too."""
    rows = []
    for a in align_batch(completions, targets):
        exact = a.first_error == a.n_target == a.n_pred
        rows.append([1] * a.first_error + [int(exact)])
    return _padded(rows)


def position_decisions(completions: Sequence[str], targets: Sequence[str]) -> Tensor:
    """``credit: position``: every decision of each completion against the target's at the same position, [N, J]
    int8. A completion of L words makes L + 1 decisions: word j (right when it is the target's word j) and then its
    stop (right when L is the target's length); -1 past its stop. A copy of one fragment is wrong from its second word
    on, an extra word is the stop decided wrong, one wrong word costs that word alone."""
    return _padded(_position_rows(completions, targets))


def pair_decisions(completions: Sequence[str], targets: Sequence[str]) -> Tensor:
    """``credit: pair``: `position_decisions` with both words of a pair judged together, [N, J] int8: words ``2i`` and
    ``2i + 1`` are right when both sit at their positions (a pair the answer left unfinished is wrong). An answer
    that writes fragment A at its positions and fills B's slots with anything earns nothing for its A words."""
    rows = []
    for *words, stop in _position_rows(completions, targets):
        paired = words + [0]  # an unfinished pair's missing word is wrong
        rows.append([paired[j] & paired[j ^ 1] for j in range(len(words))] + [stop])
    return _padded(rows)


def _position_rows(completions: Sequence[str], targets: Sequence[str]) -> list[list[int]]:
    """Per completion of L words, its L + 1 decisions at their positions (`position_decisions`), unpadded."""
    rows = []
    for completion, target in zip(completions, targets, strict=True):
        said, wanted = completion.split(), target.split()
        words = [int(j < len(wanted) and word == wanted[j]) for j, word in enumerate(said)]
        rows.append(words + [int(len(said) == len(wanted))])
    return rows


def _padded(rows: list[list[int]]) -> Tensor:
    """Rows of 0/1 decisions as one [N, J] int8 tensor, -1 after each row."""
    out = torch.full((len(rows), max(map(len, rows), default=1)), -1, dtype=torch.int8)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int8)
    return out


DECISIONS = {"word": prefix_decisions, "position": position_decisions, "pair": pair_decisions}


def word_advantages(word_index: Tensor, decisions: Tensor, num_generations: int, sequence: Tensor) -> Tensor:
    """Per-token advantages: on a token of word ``j`` where its completion made decision ``j``, ``right - p_j`` with
    ``p_j`` the share of the group's decisions at ``j`` that are right; elsewhere in the mask the completion's
    sequence advantage; 0 outside the mask. [N, C] float32.

    Args:
        word_index: ``[N, C]`` the word each token writes (`token_word_index`), -1 outside the mask.
        decisions: ``[N, J]`` 1 right, 0 wrong, -1 none (`DECISIONS`).
        num_generations: ``G``; rows are group-major.
        sequence: ``[N]`` the completions' sequence advantages (`grpo.group_advantages`).
    """
    n, _ = word_index.shape
    if n % num_generations:
        raise ValueError(f"{n} rows do not split into groups of num_generations={num_generations}")
    decisions = decisions.to(word_index.device)
    n_positions = max(int(word_index.max().item()) + 1, decisions.shape[1])
    decisions = F.pad(decisions, (0, n_positions - decisions.shape[1]), value=-1)  # [N, J]
    made, right = decisions >= 0, decisions > 0  # [N, J]
    grouped = lambda x: x.view(-1, num_generations, n_positions).float()  # noqa: E731  [P, G, J]
    p = grouped(right).sum(1) / grouped(made).sum(1).clamp(min=1)  # [P, J] the group's share right at j
    per_position = right.float() - p.repeat_interleave(num_generations, dim=0)  # [N, J]
    after = sequence.to(per_position)[:, None].expand_as(per_position)  # [N, J]
    per_position = torch.where(made, per_position, after)  # no decision of its own: the answer's advantage
    advantages = per_position.gather(1, word_index.clamp(min=0))  # [N, C]
    return torch.where(word_index >= 0, advantages, torch.zeros_like(advantages))  # [N, C]


def word_decisions(
    tokenizer, rollout: Rollout, targets: Sequence[str], stop_ids: Sequence[int], credit: str
) -> tuple[Tensor, Tensor, float]:
    """What per-word credit needs of a rollout: the word each token writes ([N, C], `token_word_index`), each
    completion's decisions ([N, J], `DECISIONS[credit]`), and the share of completions left without credit because
    their tokens, decoded one at a time, did not give back their text. `word_advantages` turns them into per-token
    advantages once the sequence advantages are final (dynamic sampling and batch scaling come after the rollout)."""
    words = token_word_index(tokenizer, rollout.completion_ids, rollout.completion_mask, stop_ids, rollout.texts)
    written = rollout.completion_mask.bool().any(1)  # [N] rows with at least one token
    unmatched = ((words < 0).all(1) & written).float().mean().item()
    return words, without_unmade_stops(DECISIONS[credit](rollout.texts, targets), rollout), unmatched


def without_unmade_stops(decisions: Tensor, rollout: Rollout) -> Tensor:
    """A completion cut by the token budget never decided to stop: its decision after its last word is none (-1),
    whatever its words were; its trailing tokens there get its sequence advantage."""
    out = decisions.clone()
    for row in rollout.truncated.nonzero().flatten().tolist():
        n_words = len(rollout.texts[row].split())
        if n_words < out.shape[1]:
            out[row, n_words] = -1
    return out

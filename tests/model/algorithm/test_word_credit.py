"""Per-word credit: which word each token writes (real families' tokenizers), each completion's decisions (on the
target's path, or at each position), the group's baselines, and the loss and a GRPO step taking per-token
advantages."""

from __future__ import annotations

import pytest
import torch

import interleave_model.algorithm.word_credit as word_credit_py
from interleave_model.algorithm import grpo
from interleave_model.algorithm.records import Trajectory
from interleave_model.algorithm.word_credit import (
    pair_decisions,
    position_decisions,
    prefix_decisions,
    token_word_index,
    word_advantages,
)
from interleave_model.generation.rollout import Rollout, completion_texts
from interleave_model.model.policy import load_pretrained, stop_token_ids
from interleave_model.module import InterleaveGRPO
from tests.conftest import fit_one_grpo_step

TARGET = "a1 b1 a2 b2 a3 b3"


def _rows(decisions: torch.Tensor) -> list[list[int]]:
    return [[d for d in row if d >= 0] for row in decisions.tolist()]


def test_prefix_decisions_are_the_common_prefix_then_one_wrong_and_the_exact_answers_stop_is_right():
    completions = [TARGET, "a1 b1 a2", "a1 a2 a3", "a1 b1 a2 b2 a3 b3 a4", "", "x b1 a2 b2 a3 b3"]
    decisions = prefix_decisions(completions, [TARGET] * 6)
    assert decisions.dtype == torch.int8 and decisions.shape == (6, 7)
    assert _rows(decisions) == [[1] * 7, [1, 1, 1, 0], [1, 0], [1] * 6 + [0], [0], [0]]


def test_position_decisions_judge_each_word_at_its_position_and_the_stop_at_the_targets_length():
    completions = [TARGET, "a1 a2 a3", "a1 b1 x b2 a3 b3", "a1 b1 a2 b2 a3 b3 a4", "a1 b1", ""]
    assert _rows(position_decisions(completions, [TARGET] * 6)) == [
        [1] * 7,  # every word and the stop
        [1, 0, 0, 0],  # a copy of fragment A: right once, then every word at the wrong place, and stopped early
        [1, 1, 0, 1, 1, 1, 1],  # one wrong word costs that word alone
        [1] * 6 + [0, 0],  # an extra word where the stop belonged, then its own stop (not at the target's length)
        [1, 1, 0],  # stopped early
        [0],  # said nothing: a stop at 0
    ]


@pytest.mark.parametrize("credit", ["word", "position", "pair"])
def test_a_completion_cut_by_the_budget_made_no_stop_decision(credit):
    texts = [TARGET, TARGET, "a1 b1"]
    roll = Rollout(*[torch.zeros(3, 1)] * 4, torch.tensor([False, True, True]), texts)
    decisions = word_credit_py.without_unmade_stops(word_credit_py.DECISIONS[credit](texts, [TARGET] * 3), roll)
    assert decisions[0, 6] == 1  # stopped at the target's length
    assert decisions[1, 6] == -1 and decisions[2, 2] == -1  # cut: no stop, right or wrong
    assert decisions[1, :6].tolist() == [1] * 6 and decisions[2, :2].tolist() == [1, 1]


def test_pair_decisions_pay_a_pair_only_when_both_its_words_are_in_place():
    completions = [TARGET, "a1 a1 a2 a2 a3 a3", "a1 b1 a2 x a3 b3", "a1 b1 a2", "a1 b1 a2 b2 a3 b3 a4"]
    assert _rows(pair_decisions(completions, [TARGET] * 5)) == [
        [1] * 7,
        [0] * 6 + [1],  # fragment A at its positions, B's slots filled with A again: no pair right (the stop is)
        [1, 1, 0, 0, 1, 1, 1],  # one wrong word costs its pair
        [1, 1, 0, 0],  # a pair left unfinished is wrong, and so is the early stop
        [1] * 6 + [0, 0],  # the word where the stop belonged has no partner: wrong
    ]


def test_each_word_is_paid_against_the_group_at_the_same_state():
    # one group of 4; completion r writes word j with tokens word_index == j (one token per word, then its stop)
    first_wrong = [3, 1, 1, 0]  # on the target's path: right before k, wrong at k, none after
    decisions = torch.tensor([[1] * k + [0] + [-1] * (3 - k) for k in first_wrong], dtype=torch.int8)
    word_index = torch.tensor([[0, 1, 2, 3], [0, 1, 2, -1], [0, 1, -1, -1], [0, 1, 2, 3]])
    sequence = torch.tensor([0.9, -0.1, -0.2, -0.6])
    adv = word_advantages(word_index, decisions, num_generations=4, sequence=sequence)
    # word 0: reached by all 4, right in 3 -> p = 3/4; word 1: reached by 3, right in 1 -> p = 1/3;
    # word 2: reached by 1 (the first), right -> p = 1 -> 0; word 3: the first's mistake, reached by it alone -> 0
    expected = torch.tensor(
        [
            [1 - 3 / 4, 1 - 1 / 3, 0.0, 0.0],
            [1 - 3 / 4, 0 - 1 / 3, -0.1, 0.0],  # word 2 is past its mistake: the answer's own advantage
            [1 - 3 / 4, 0 - 1 / 3, 0.0, 0.0],  # (outside the mask: 0)
            [0 - 3 / 4, -0.6, -0.6, -0.6],  # wrong at once; the rest judged with the answer
        ]
    )
    torch.testing.assert_close(adv, expected)


def test_groups_do_not_share_baselines():
    word_index = torch.tensor([[0], [0], [0], [0]])
    decisions = torch.tensor([[1], [0], [1], [1]], dtype=torch.int8)
    adv = word_advantages(word_index, decisions, num_generations=2, sequence=torch.zeros(4))
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_position_credit_pays_interleaving_and_charges_a_copy():
    """A group of 2 (one token per word, then the stop): the answer that interleaves gets its words past the first
    paid, the copy of fragment A is charged for the same positions; the shared first word and a decision both get
    wrong get 0."""
    completions = ["a1 b1 a2 b2 a3 b3", "a1 a2 a3"]
    decisions = position_decisions(completions, [TARGET] * 2)
    word_index = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, -1, -1, -1]])
    adv = word_advantages(word_index, decisions, num_generations=2, sequence=torch.tensor([9.0, -9.0]))
    torch.testing.assert_close(adv[0], torch.tensor([0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(adv[1], torch.tensor([0.0, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0]))


def test_word_credit_composes_the_final_sequence_advantages():
    """The update composes per-token advantages from the trajectory's sequence advantages as they are at update time,
    so a batch-wide rescaling (or a refill) after the rollout reaches the tokens past a completion's path."""
    decisions = torch.tensor([[1, 0], [0, -1]], dtype=torch.int8)
    word_index = torch.tensor([[0, 1, 2], [0, 1, 2]])
    t = Trajectory(*[None] * 6, torch.zeros(2), torch.tensor([1.0, -1.0]), None, word_index, decisions)
    assert torch.equal(Trajectory(*[None] * 6, torch.zeros(2), torch.ones(2), None).token_advantages(2), torch.ones(2))
    torch.testing.assert_close(t.token_advantages(2), torch.tensor([[0.5, 0.0, 1.0], [-0.5, -1.0, -1.0]]))
    scaled = t._replace(advantages=torch.tensor([2.0, -2.0]))
    torch.testing.assert_close(scaled.token_advantages(2), torch.tensor([[0.5, 0.0, 2.0], [-0.5, -2.0, -2.0]]))


def test_per_token_advantages_equal_to_the_sequence_one_give_the_sequence_loss():
    torch.manual_seed(0)
    logprobs = torch.randn(3, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    seq = torch.tensor([0.5, -1.0, 2.0])
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        a = grpo.policy_loss(logprobs, logprobs.detach(), seq, mask, loss_type=loss_type, max_completion_length=5)
        b = grpo.policy_loss(logprobs, logprobs.detach(), seq[:, None].expand(3, 5), mask, loss_type=loss_type,
                             max_completion_length=5)  # fmt: skip
        torch.testing.assert_close(a.loss, b.loss)
    with pytest.raises(ValueError, match=r"\[N\] or \[N, L\]"):
        grpo.policy_loss(logprobs, logprobs.detach(), torch.zeros(3, 4), mask)


def test_tokens_map_to_the_words_they_write_on_real_families(family):
    """Byte-level BPE splits words into several tokens and glues the space to the next word; the stop token and
    padding come after. Each word's tokens, decoded together, must give back that word."""
    _, folder = family
    model, tokenizer = load_pretrained(str(folder))
    stop_ids = stop_token_ids(model, tokenizer)
    answers = ["types, and empty strings", "containers (including tuples", "ab"]
    rows = [tokenizer.encode(text, add_special_tokens=False) + [stop_ids[0]] for text in answers]
    width = max(map(len, rows)) + 2
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    texts = completion_texts(tokenizer, ids, stop_ids)
    assert texts == answers
    index = token_word_index(tokenizer, ids, mask, stop_ids, texts)
    for row, text in enumerate(texts):
        n = len(rows[row])
        words = text.split()
        assert index[row, n - 1] == len(words)  # the stop: the decision after the last word
        assert (index[row, n:] == -1).all()
        for j, word in enumerate(words):
            tokens = [rows[row][t] for t in range(n - 1) if index[row, t] == j]
            assert tokenizer.decode(tokens).strip() == word


def test_a_row_decoded_apart_differently_gets_no_credit(family):
    _, folder = family
    model, tokenizer = load_pretrained(str(folder))
    stop_ids = stop_token_ids(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("one two three", add_special_tokens=False)])
    index = token_word_index(tokenizer, ids, torch.ones_like(ids), stop_ids, ["one two four"])
    assert (index == -1).all()


@pytest.mark.parametrize("credit", ["word", "position"])
def test_a_grpo_step_with_word_credit_trains_on_per_token_advantages(
    credit, family_folders, make_datamodule, monkeypatch
):
    module = InterleaveGRPO(
        base={"name_or_path": str(family_folders["llama3"])}, template="compact",
        sampling={"num_generations": 4, "temperature": 20.0},  # the random folder is near one-hot at T 1
        loss={"beta": 0.0, "credit": credit}, optimization={"warmup_steps": 0, "learning_rate": 1e-2},
    )  # fmt: skip
    seen = []
    policy_loss = grpo.policy_loss

    def spy(logprobs, old, advantages, mask, **kwargs):
        seen.append((advantages.clone(), mask.clone()))
        return policy_loss(logprobs, old, advantages, mask, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    # a random model's answers all fail at word 0 (no signal): say every other one got its first word right
    alternate = lambda texts, targets: torch.tensor([[1, 0] if i % 2 else [0, -1] for i in range(len(texts))])  # noqa: E731
    monkeypatch.setitem(word_credit_py.DECISIONS, credit, alternate)
    before = [p.detach().clone() for p in module.policy.parameters() if p.requires_grad]
    trainer = fit_one_grpo_step(module, make_datamodule)
    (advantages, mask), *_ = seen
    assert advantages.shape == mask.shape  # one advantage per completion token
    assert (advantages[mask == 0] == 0).all()
    first_words = advantages[:, 0]  # the first token of every row writes its word 0 (or stops)
    torch.testing.assert_close(first_words, torch.tensor([-0.5, 0.5] * (len(first_words) // 2)))
    assert "train/word_credit_unmatched" in trainer.callback_metrics
    assert trainer.callback_metrics["train/word_credit_unmatched"] == 0.0
    after = [p.detach() for p in module.policy.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))

"""Hinted GRPO prompts (interleave_data/hints.py): the answer's first pairs after the prompt, the rest to answer."""

import random

import pytest

from interleave_data.corpus import CorpusError
from interleave_data.hints import HintSettings, draw_pairs, most_pairs, split_hint
from interleave_data.pairs import Example
from interleave_data.prompts import format_prompt
from interleave_model.model.policy import load_pretrained

EXAMPLE = Example("3w-train-0", 3, "a1 a2 a3", "b1 b2 b3", "a1 b1 a2 b2 a3 b3", "t0", "t1", "train", 0, 0)


def test_split_hint_gives_the_first_pairs_and_leaves_the_rest_of_each_fragment_and_the_answer():
    hint, rest = split_hint(EXAMPLE, 2)
    assert hint == "a1 b1 a2 b2"
    assert (rest.a, rest.b, rest.target) == ("a3", "b3", "a3 b3")
    assert (rest.id, rest.n_words) == (EXAMPLE.id, EXAMPLE.n_words)  # the stage it counts for is the example's
    assert split_hint(EXAMPLE, 0) == ("", EXAMPLE)


def test_the_most_pairs_fall_linearly_to_none_and_every_draw_leaves_a_pair_to_answer():
    settings = HintSettings(pairs=4, decay_steps=8)
    assert [most_pairs(settings, t) for t in (0, 2, 4, 6, 8, 20)] == [4, 3, 2, 1, 0, 0]
    assert most_pairs(HintSettings(pairs=3), 1000) == 3  # no decay
    draws = draw_pairs(random.Random(0), [EXAMPLE] * 200, most=4)
    assert set(draws) == {0, 1, 2}  # uniform in 0..4, but 3 words leave at most 2 pairs as a hint
    assert draw_pairs(random.Random(0), [EXAMPLE] * 5, most=0) == [0] * 5
    with pytest.raises(CorpusError, match="data.hints: pairs and decay_steps must be >= 0"):
        HintSettings(pairs=-1)


def test_grpo_batches_carry_hints_that_decay_and_other_batches_none(make_datamodule, tokenizer):
    dm = make_datamodule(tokenizer, stages=(8,), batch_size=16, hints=HintSettings(pairs=6, decay_steps=4))
    hinted = [dm._collate_train((k, "grpo", dm.sample_train_batch(k)[1])) for k in range(6)]
    given = [[len(p.split("Interleave:")[1].split()) // 2 for p in b["prompts"]] for b in hinted]
    assert max(given[0]) == 6 and max(given[2]) <= 3 and given[4] == given[5] == [0] * 16
    again = dm._collate_train((0, "grpo", dm.sample_train_batch(0)[1]))
    assert again["prompts"] == hinted[0]["prompts"]  # a resumed run draws the same hints
    for batch in hinted[:2]:
        for prompt, target, words in zip(batch["prompts"], batch["targets"], batch["n_words"], strict=True):
            hint = prompt.split("Interleave:")[1].split()
            assert len(hint) + len(target.split()) == 2 * words  # the hint and the rest make the whole answer
    sft = dm.collate(dm.examples(8, "train")[:2], "sft")
    assert all(p.endswith("Interleave:") for p in sft["prompts"])


def test_a_hint_is_the_answers_first_tokens_on_real_tokenizers(family, make_datamodule):
    """Byte-level BPE with a chat template: the prompt's ids end with the ids the warm-start trains the answer's start
    as, and the target left is what follows them."""
    _, tokenizer = load_pretrained(str(family[1]))
    dm = make_datamodule(tokenizer, stages=(8,))
    example = dm.examples(8, "train")[0]
    batch = dm.collate([example], "grpo", hints=[3])
    ids = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()
    prompt = tokenizer(format_prompt(example.a, example.b, "compact", tokenizer), add_special_tokens=False)
    whole = tokenizer(example.target, add_special_tokens=False)["input_ids"]
    hint = ids[len(prompt["input_ids"]) :]
    assert ids[: len(prompt["input_ids"])] == prompt["input_ids"]
    assert hint and whole[: len(hint)] == hint
    assert tokenizer.decode(hint).split() == example.target.split()[:6]
    assert batch["targets"] == [" ".join(example.target.split()[6:])]


def test_a_hinted_grpo_step_scores_what_follows_the_hint(family_folders, make_datamodule):
    """On the Llama-3 folder: the reward sees each completion against the answer left after its prompt's hint."""
    from interleave_model.algorithm.rewards import AlignmentReward
    from interleave_model.module import InterleaveGRPO
    from tests.conftest import fit_one_grpo_step

    seen = []

    class Recording(AlignmentReward):
        def __call__(self, completions, targets, truncated, **fields):
            seen.append((list(targets), list(fields["prompts"])))
            return super().__call__(completions, targets, truncated, **fields)

    module = InterleaveGRPO(
        base={"name_or_path": str(family_folders["llama3"])}, template="compact", sampling={"num_generations": 2},
        kl={"beta": 0.0}, rewards=[Recording()],
    )  # fmt: skip
    fit_one_grpo_step(module, make_datamodule, batch_size=4, hints=HintSettings(pairs=2))
    (targets, prompts), *_ = seen
    lengths = {len(t.split()) for t in targets}
    assert lengths <= {2, 4, 6} and len(lengths) > 1  # 3-word pairs given 0, 1 or 2 pairs
    for target, prompt in zip(targets, prompts, strict=True):
        given = prompt.rsplit("\n", 1)[-1].split() if len(target.split()) < 6 else []
        assert len(given) + len(target.split()) == 6

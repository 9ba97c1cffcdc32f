"""pass@k, diversity and SampledAnswers: hand-computed values, and states that add up across ranks."""

import math

import pytest
import torch
from torchmetrics.utilities.data import dim_zero_sum

from interleave_model.evaluation.evaluator import (
    GREEDY_KEYS,
    SampledAnswers,
    distinct_answers,
    length_row,
    pass_at_k,
    resolve_pass_k,
    self_similarity,
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),  # 1 - C(3,1)/C(5,1) = 1 - 3/5: pass@1 is the share of correct samples
        (5, 2, 2, 7 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 2, 1 / 2),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 1 - 1/12
        (8, 1, 8, 1.0),  # n - c = 7 < k = 8: every draw of 8 holds the correct one
        (5, 4, 2, 1.0),  # n - c = 1 < k = 2
        (5, 0, 3, 0.0),  # no correct sample: C(5,3)/C(5,3) = 1
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_equals_the_binomial_formula():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k)), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 5, 1), (4, -1, 1), (4, 1, 0)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_resolve_pass_k():
    assert resolve_pass_k(0, [1, 8]) == []  # no sampling, no pass@k
    assert resolve_pass_k(8, None) == [1, 8]
    assert resolve_pass_k(1, None) == [1]
    assert resolve_pass_k(8, [4, 1, 4]) == [1, 4]
    with pytest.raises(ValueError, match="num_samples=4"):
        resolve_pass_k(4, [1, 8])
    with pytest.raises(ValueError, match=">= 0"):
        resolve_pass_k(-1, None)


def test_distinct_answers_compares_words():
    assert distinct_answers(["a b", " a  b ", "b a"]) == 2  # whitespace does not make an answer different
    assert distinct_answers(["x"] * 16) == 1  # the collapse: 16 identical completions
    assert distinct_answers([]) == 0


def test_self_similarity_by_hand():
    # pairs: (1,2) identical = 1; (1,3) and (2,3) differ in 1 of 4 words = 3/4 each -> (1 + 3/4 + 3/4) / 3
    assert self_similarity(["a b c d", "a b c d", "a b x d"]) == pytest.approx(2.5 / 3)
    assert self_similarity(["a b", "c d"]) == 0.0
    assert self_similarity(["a b"] * 5) == 1.0
    assert math.isnan(self_similarity(["only one"]))


TARGET = "a1 b1 a2 b2"
GROUPS = [
    [TARGET, TARGET, "a1 b1 a2", "x"],  # 2 of 4 correct; scores 1, 1, 3/4, 0
    ["a1 b1 a2 x", "a1 b1 a2 x"],  # none correct, collapsed; scores 3/4, 3/4
]


def test_sampled_answers_by_hand():
    metric = SampledAnswers(ks=[2, 1])
    metric.update(GROUPS, [TARGET, TARGET])
    values = metric.compute_all()
    # group 1: n=4, c=2: pass@1 = 1/2, pass@2 = 1 - C(2,2)/C(4,2) = 5/6; group 2: c=0 -> 0, 0
    # group 1 similarity: pairs (T,T)=1, (T,"a1 b1 a2")=3/4 twice, (T,"x")=0 twice, ("a1 b1 a2","x")=0 -> 2.5/6
    expected = {
        "pass@1": (1 / 2 + 0) / 2,
        "pass@2": (5 / 6 + 0) / 2,
        "sample_score": ((1 + 1 + 3 / 4 + 0) / 4 + 3 / 4) / 2,
        "distinct": (3 + 1) / 2,
        "self_similarity": (2.5 / 6 + 1) / 2,
    }
    assert list(values) == list(expected)  # pass@k in increasing k, then the rest
    for name, value in expected.items():
        assert values[name].dtype == torch.float64
        assert values[name].item() == pytest.approx(value), name
    assert metric.compute().item() == pytest.approx(expected["pass@2"])


def test_score_threshold_relaxes_correctness():
    metric = SampledAnswers(ks=[1], threshold=0.75)
    metric.update(GROUPS, [TARGET, TARGET])
    # scores >= 3/4 count: group 1 has 3 of 4, group 2 has 2 of 2
    assert metric.compute_all()["pass@1"].item() == pytest.approx((3 / 4 + 1) / 2)


def test_states_add_up_as_under_ddp():
    """Every state is a sum, so the values over two shards (as two ranks would hold them) equal one process."""
    whole = SampledAnswers(ks=[1, 2])
    whole.update(GROUPS, [TARGET, TARGET])
    first, second = SampledAnswers(ks=[1, 2]), SampledAnswers(ks=[1, 2])
    first.update(GROUPS[:1], [TARGET])
    second.update(GROUPS[1:], [TARGET])
    assert all(fx is dim_zero_sum for fx in first._reductions.values())
    first.merge_state(second)
    merged, expected = first.compute_all(), whole.compute_all()
    for name in expected:
        assert merged[name].item() == pytest.approx(expected[name].item()), name


def test_single_sample_groups_have_no_similarity():
    metric = SampledAnswers(ks=[1])
    metric.update([[TARGET]], [TARGET])
    values = metric.compute_all()
    assert values["pass@1"].item() == 1.0
    assert math.isnan(values["self_similarity"].item())


def test_update_checks_sizes():
    with pytest.raises(ValueError, match="2 groups of samples for 1 targets"):
        SampledAnswers().update(GROUPS, [TARGET])
    with pytest.raises(ValueError, match="k >= 1"):
        SampledAnswers(ks=[0])


def test_length_row():
    greedy = {key: torch.tensor(0.5, dtype=torch.float64) for key in GREEDY_KEYS}
    greedy["texts"] = torch.tensor(3.0, dtype=torch.float64)  # AlignmentScore counts the texts in float64
    row = length_row(10, 4, greedy, {"pass@1": torch.tensor(0.25)})
    assert row == {"n_words": 10, "pairs": 4, "texts": 3, **dict.fromkeys(GREEDY_KEYS, 0.5), "pass@1": 0.25}
    assert isinstance(row["texts"], int)
    assert all(isinstance(v, float) for k, v in row.items() if k not in ("n_words", "pairs", "texts"))


def test_sampled_answers_only_at_the_sample_lengths():
    """`sample_lengths` [10]: a 10-word batch gets 3 sampled answers a prompt, a 25-word one greedy answers only."""
    from interleave_model.evaluation.evaluator import Evaluator
    from interleave_model.settings.evaluation import Evaluation

    evaluator = Evaluator(Evaluation(num_samples=3, sample_lengths=[10]), seed=0)
    calls = []

    def sample(batch, n, temperature, generator):
        calls.append(n)
        return [f"answer {i}" for i in range(len(batch["targets"]) * n)]

    for words in (10, 25):
        batch = {"n_words": [words, words], "targets": ["a b", "c d"]}
        greedy, groups = evaluator.answers(batch, 0, 0, torch.device("cpu"), sample)
        assert len(greedy) == 2 and (groups is None) is (words == 25)
    assert calls == [3, 1, 1]  # sampled and greedy at 10 words, greedy only at 25


def test_metric_names_come_from_one_place_and_read_back():
    """The score is logged as "alignment" under its split and length; `logged_scores` reads every length's back, and
    nothing else that shares the prefix."""
    from interleave_model.evaluation.evaluator import logged_scores, logged_values, metric_name

    rows = [{"n_words": 10, "pairs": 4, "score": 0.5, "score_stderr": 0.1}, {"n_words": 25, "pairs": 4, "score": 0.25}]
    logged = logged_values(rows, "val")
    assert logged == {"val/alignment_10w": 0.5, "val/score_stderr_10w": 0.1, "val/alignment_25w": 0.25}
    assert metric_name("val", "score", 10) == "val/alignment_10w" and metric_name("test", "a_accuracy", 5) == (
        "test/a_accuracy_5w"
    )
    logged |= {"test/alignment_50w": 1.0, "val/alignment_sampled": 0.3}
    assert logged_scores(logged) == {10: 0.5, 25: 0.25} and logged_scores(logged, "test") == {50: 1.0}


def test_the_lengths_a_callback_monitors_are_read_from_its_metric_name():
    from types import SimpleNamespace

    from interleave_model.evaluation.evaluator import monitored_lengths

    monitors = ["val/alignment_25w", "val/exact_match_100w", "test/alignment_50w", "train/reward_mean", "val/x", None]
    callbacks = [SimpleNamespace(monitor=m) for m in monitors] + [object()]
    assert monitored_lengths(callbacks) == {25, 100}


def test_a_lora_policys_evaluation_draws_from_a_merged_copy_freed_at_its_end(make_module, make_datamodule, monkeypatch):
    """Validation, test and predict of a LoRA policy draw from one merged copy each, freed when they end."""
    import lightning as L

    from interleave_model.generation import sampler as sampler_py
    from interleave_model.settings.policy import LoraSettings

    module = make_module(lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    datamodule = make_datamodule(module.tokenizer)
    built, held = [], []
    real = sampler_py.MergedCopy
    monkeypatch.setattr(sampler_py, "MergedCopy", lambda *a: built.append(a[1]) or real(*a))

    def ended():
        held.append(module.sampler.held_out)
        module.sampler.held_out = None

    monkeypatch.setattr(module.sampler, "evaluation_ended", ended)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.test(module, datamodule=datamodule, verbose=False)
    trainer.predict(module, datamodule=datamodule)
    assert built == ["float32"] * 3 and len(held) == 3 and all(copy is not None for copy in held)
    assert module.sampler.held_out is None

"""Speculative sampling: greedy answers equal HF `generate` (three families, left padding, stops, retired rows), the
sampled sequences have the model's distribution (a chi-square test against the exact one), the recorded log-probs are
the trainer's scores, and the sampler uses it when `model.sampling.speculative_tokens` asks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from interleave_data.prompts import format_prompt
from interleave_model.algorithm.completions import completion_logprobs
from interleave_model.generation import merged_copy
from interleave_model.generation import sampler as sampler_module
from interleave_model.generation.merged_copy import MergedCopy
from interleave_model.generation.rollout import sample
from interleave_model.generation.sampling_params import SamplingParams, Speculation
from interleave_model.generation.speculative import Lookup, _sampling_probs, speculative_sample
from interleave_model.model.policy import load_pretrained, stop_token_ids
from interleave_model.settings import SettingsError
from interleave_model.settings.sampling import Sampling
from tests.model.generation.test_rollout import _spread_weights

# a chi-square test's false alarms: a correct sampler fails one run in FALSE_ALARM of each test below
FALSE_ALARM = 1e-4


def test_lookup_drafts_the_continuation_of_the_longest_suffix_found():
    lookup = Lookup([[5, 6, 7, 5, 8, 9, 2]], ngram=2, k=3, filler=0)
    assert lookup.draft([[]]) == [[5, 6, 7]]  # nothing to match: the source's start
    assert lookup.draft([[1, 5]]) == [[6, 7, 5]]  # the first 5 (no earlier match to follow)
    assert lookup.draft([[1, 5, 6, 7, 5]]) == [[8, 9, 2]]  # the second 5: it follows the last match
    assert lookup.draft([[7, 5, 8, 9]]) == [[2, 0, 0]]  # the source runs out: filler
    assert lookup.draft([[4]]) == [[5, 6, 7]]


def _stop_after_tokens_divisible_by(model, stop: int, divisor: int) -> None:
    """Make `stop` the next token after every input token that is a multiple of `divisor`, at every position of a
    forward (a speculative step scores several): rows end at steps set by their own tokens."""
    inputs = {}

    def remember(module, args, output):  # input ids [N, L]
        inputs["ids"] = args[0]

    def end_rows(module, args, logits):  # logits [N, L, V]
        ends = inputs["ids"][:, -logits.shape[1] :] % divisor == 0  # [N, L]
        logits[..., stop] = torch.where(ends, logits.amax(-1) + 10.0, logits[..., stop])
        return logits

    model.get_input_embeddings().register_forward_hook(remember)
    model.get_output_embeddings().register_forward_hook(end_rows)


def _prompts(tok, texts):
    enc = tok([format_prompt(a, b, "compact", tok) for a, b in texts], return_tensors="pt", padding=True,
              add_special_tokens=not tok.chat_template)  # fmt: skip
    return enc.input_ids, enc.attention_mask


@pytest.mark.parametrize("source", ["answers", "unrelated"])
def test_greedy_with_left_padding_stops_and_retired_rows_matches_hf_generate(family, source):
    model, tok = load_pretrained(str(family[1]))
    _spread_weights(model)
    stops = stop_token_ids(model, tok)
    _stop_after_tokens_divisible_by(model, stops[-1], divisor=13)  # rows end at different steps
    ids, mask = _prompts(tok, [("a b", "c d"), ("one two three four five six", "x y z w"), ("z", "y"), ("cat", "mat")])
    assert (mask.sum(-1) < ids.shape[1]).sum() >= 2, "prompts of several lengths, left-padded"
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               eos_token_id=stops, pad_token_id=tok.pad_token_id)[:, ids.shape[1] :]  # fmt: skip
    assert len(set(map(tuple, reference.tolist()))) == 4, "every prompt its own answer"
    # drafts from the answers themselves are kept (up to where HF's answer stops), unrelated ones rejected
    sources = reference.tolist() if source == "answers" else [[7, 8, 9]] * 4
    counts = {}
    params = SamplingParams(num_generations=2, max_new_tokens=24, stop_ids=stops, temperature=0.0)
    drafts = replace(params, speculation=Speculation(sources, draft_tokens=3, ngram=2))
    completion, mask_, truncated, _ = speculative_sample(model, ids, mask, drafts, pad_token_id=tok.pad_token_id,
                                                         counts=counts)  # fmt: skip
    plain = sample(model, ids, mask, params, pad_token_id=tok.pad_token_id)
    for g in range(2):
        assert torch.equal(completion[g::2][:, : reference.shape[1]], reference)
    assert torch.equal(completion, plain[0]) and torch.equal(mask_, plain[1]) and torch.equal(truncated, plain[2])
    assert len(set(mask_.sum(-1).tolist())) >= 3, "rows end at different steps (so rows retire while others run)"
    if source == "answers":
        assert counts["kept"] > counts["drafted"] / 2 and counts["forwards"] < 12  # < 24 steps of one token
    else:
        assert counts["kept"] < counts["drafted"] / 5


def test_drafts_only_in_steps_of_at_most_max_rows_and_answers_as_without(family_folders):
    model, tok = load_pretrained(str(family_folders["llama3"]))
    _spread_weights(model)
    stops = stop_token_ids(model, tok)
    _stop_after_tokens_divisible_by(model, stops[-1], divisor=13)  # rows end at different steps
    ids, mask = _prompts(tok, [("a b", "c d"), ("one two three four five six", "x y z w"), ("z", "y"), ("cat", "mat")])
    widths = []  # each forward's (rows, tokens a row)
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: widths.append(tuple(args[0].shape)))
    params = SamplingParams(num_generations=2, max_new_tokens=24, stop_ids=stops, temperature=0.0)
    plain = sample(model, ids, mask, params, pad_token_id=tok.pad_token_id)
    sources = [row[m.bool()].tolist() for row, m in zip(plain[0][::2], plain[1][::2], strict=True)]
    runs = {}
    for max_rows in (None, 4):
        widths.clear()
        counts = {}
        drafts = replace(params, speculation=Speculation(sources, draft_tokens=3, ngram=2, max_rows=max_rows))
        out = speculative_sample(model, ids, mask, drafts, pad_token_id=tok.pad_token_id, counts=counts)
        assert all(torch.equal(a, b) for a, b in zip(out[:3], plain[:3], strict=True))
        runs[max_rows] = counts, widths[1:]  # the prefill left out
    (every, every_widths), (small, small_widths) = runs[None], runs[4]
    assert {width for rows, width in every_widths} == {4}  # the last token and 3 drafted, at 8 rows and fewer
    assert all(width == (4 if rows <= 4 else 1) for rows, width in small_widths)
    assert {rows > 4 for rows, _ in small_widths} == {True, False}, "steps of 8 rows, then of at most 4"
    assert 0 < small["drafted"] < every["drafted"] and small["forwards"] > every["forwards"]


def test_on_the_merged_copy_speculation_attends_by_blocks_and_keeps_its_answers_and_scores(family, monkeypatch):
    """The copy the training rollout samples from runs a speculative step's drafted block through its own grouped
    attention: greedy answers are the copy's plain ones, and sampled log-probs the trainer's scores."""
    model, tok = load_pretrained(str(family[1]))
    _spread_weights(model, std=0.1)
    copy, stopping = (MergedCopy(model, "float32").refresh(version=0) for _ in range(2))
    stops = stop_token_ids(model, tok)
    _stop_after_tokens_divisible_by(stopping, stops[-1], divisor=13)  # rows end at different steps
    ids, mask = _prompts(tok, [("a b", "c d"), ("one two three four five six", "x y z w"), ("z", "y")])
    blocks = []
    softmax = merged_copy._masked_softmax
    monkeypatch.setattr(merged_copy, "_masked_softmax", lambda scores, m, t: blocks.append(t) or softmax(scores, m, t))
    params = SamplingParams(num_generations=2, max_new_tokens=20, stop_ids=stops, temperature=0.0)
    plain = sample(stopping, ids, mask, params, pad_token_id=tok.pad_token_id)
    assert len(set(plain[1].sum(-1).tolist())) >= 2, "rows end at different steps"
    answers = [row[m.bool()].tolist() for row, m in zip(plain[0][::2], plain[1][::2], strict=True)]
    counts = {}
    params = replace(params, speculation=Speculation(answers, draft_tokens=3, ngram=2))
    greedy = speculative_sample(stopping, ids, mask, params, pad_token_id=tok.pad_token_id, counts=counts)
    assert all(torch.equal(a, b) for a, b in zip(greedy[:3], plain[:3], strict=True))
    assert counts["kept"] > counts["drafted"] / 2
    uses_grouped = copy.config._attn_implementation == merged_copy.GROUPED_DECODE
    assert (4 in blocks) == uses_grouped  # the last token and 3 drafted, attended by the copy's own attention
    completion, completion_mask, _, logprobs = speculative_sample(
        copy, ids, mask, replace(params, temperature=0.8, with_logprobs=True), torch.Generator().manual_seed(0),
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    input_ids = torch.cat([ids.repeat_interleave(2, dim=0), completion], dim=-1)
    attention = torch.cat([mask.repeat_interleave(2, dim=0), completion_mask], dim=-1)
    scores, _ = completion_logprobs(model, input_ids, attention, completion, 0.8)
    assert torch.allclose(logprobs, scores * completion_mask, atol=1e-4)


def _small_model(seed: int = 0) -> LlamaForCausalLM:
    """A 1-layer Llama over 5 tokens whose next-token distributions are far from uniform and differ by context."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=4)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, 0.8)
    return model


STOP, PAD = 4, 0


def _exact(model, prompt: list[int], steps: int, temperature, top_p, top_k) -> dict[tuple[int, ...], float]:
    """Each sequence's probability under the sampler's rule, from the model's distribution after every prefix; a
    sequence ends at `STOP` and is padded with `PAD` after it."""
    probs = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, p in probs.items():
            if STOP in seq:
                nxt[seq + (PAD,)] = p
                continue
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1]
            dist = _sampling_probs(logits, temperature, top_p, top_k)
            for token, q in enumerate(dist.tolist()):
                if q > 0:
                    nxt[seq + (token,)] = p * q
        probs = nxt
    return probs


def _chi_square_p(observed: dict, expected: dict[tuple[int, ...], float], n: int) -> float:
    """p-value of Pearson's chi-square test of `observed` counts against `expected` probabilities (cells of expected
    count below 5 pooled into one), from the regularized upper incomplete gamma function."""
    cells, pooled_o, pooled_e = [], 0, 0.0
    for seq, p in expected.items():
        e = p * n
        if e < 5:
            pooled_o, pooled_e = pooled_o + observed.get(seq, 0), pooled_e + e
        else:
            cells.append((observed.get(seq, 0), e))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    assert sum(o for o, _ in cells) == n, "a sampled sequence the exact distribution gives probability 0"
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "max_rows"),
                         [(1.0, 1.0, 0, None), (0.7, 0.9, 0, None), (1.3, 1.0, 3, None), (1.0, 1.0, 0, 0)])  # fmt: skip
def test_sampled_sequences_have_the_models_distribution(temperature, top_p, top_k, max_rows):
    model, prompt, steps, n = _small_model(), [1, 2, 3], 3, 20000
    expected = _exact(model, prompt, steps, temperature, top_p, top_k)
    params = SamplingParams(num_generations=n, max_new_tokens=steps, stop_ids=[STOP], temperature=temperature,
                            top_p=top_p, top_k=top_k)  # fmt: skip
    ids = torch.tensor([prompt])
    greedy = sample(model, ids, torch.ones_like(ids), replace(params, num_generations=1, temperature=0.0),
                    pad_token_id=PAD)[0]  # fmt: skip
    counts = {}  # drafts: the greedy answer, often but not always what a sample draws
    drafts = replace(params, speculation=Speculation(greedy.tolist(), draft_tokens=2, ngram=1, max_rows=max_rows))
    drafted, *_ = speculative_sample(model, ids, torch.ones_like(ids), drafts, torch.Generator().manual_seed(1),
                                     pad_token_id=PAD, counts=counts)  # fmt: skip
    plain, *_ = sample(model, ids, torch.ones_like(ids), params, torch.Generator().manual_seed(2), pad_token_id=PAD)

    if max_rows == 0:  # no step drafts: each draws as a plain step, through the speculative path
        assert counts["drafted"] == 0 and counts["forwards"] == steps - 1
    else:
        assert 0.1 < counts["kept"] / counts["drafted"] < 0.98, "drafts both kept and rejected, in thousands"
    for draws in (drafted, plain):  # the plain sampler as the test's control
        observed = {}
        for row in draws.tolist():
            observed[tuple(row)] = observed.get(tuple(row), 0) + 1
        assert _chi_square_p(observed, expected, n) > FALSE_ALARM


def test_a_wrong_sampler_fails_the_distribution_test():
    """The test's power: a sampler that keeps every drafted token (no rejection) is caught."""
    model, prompt, steps, n = _small_model(), [1, 2, 3], 3, 20000
    expected = _exact(model, prompt, steps, 1.0, 1.0, 0)
    observed = {}
    ids = torch.tensor([prompt])
    params = SamplingParams(num_generations=n, max_new_tokens=steps, stop_ids=[STOP])
    plain, *_ = sample(model, ids, torch.ones_like(ids), params, torch.Generator().manual_seed(3), pad_token_id=PAD)
    for i, row in enumerate(plain.tolist()):
        seq = (2, 1, 3) if i % 2 == 0 else tuple(row)  # half the rows answer the draft outright
        observed[seq] = observed.get(seq, 0) + 1
    assert _chi_square_p(observed, expected, n) < 1e-12


def test_recorded_log_probs_are_the_trainers_scores(family_folders):
    model, tok = load_pretrained(str(family_folders["qwen2"]))
    _spread_weights(model, std=0.1)
    stops = stop_token_ids(model, tok)
    ids, mask = _prompts(tok, [("a b", "c d"), ("one two three", "x y")])
    drafts = Speculation([[5, 6, 7], [8, 9]], draft_tokens=3, ngram=2)
    params = SamplingParams(num_generations=3, max_new_tokens=10, stop_ids=stops, temperature=0.8, with_logprobs=True,
                            speculation=drafts)  # fmt: skip
    completion, completion_mask, _, logprobs = speculative_sample(
        model, ids, mask, params, torch.Generator().manual_seed(0), pad_token_id=tok.pad_token_id
    )
    repeated = ids.repeat_interleave(3, dim=0), mask.repeat_interleave(3, dim=0)
    input_ids = torch.cat([repeated[0], completion], dim=-1)
    attention = torch.cat([repeated[1], completion_mask], dim=-1)
    scores, _ = completion_logprobs(model, input_ids, attention, completion, 0.8)
    assert torch.allclose(logprobs, scores * completion_mask, atol=1e-4)


def _sampled_with_spy(module) -> tuple[list[SamplingParams], object, list[int]]:
    """A greedy rollout of one prompt by the module's sampler: the speculative draw's sampling parameters in each
    call, the rollout, and the prompt's target."""
    enc = module.tokenizer(["A: the first B: a second Interleave:"], return_tensors="pt")
    target = module.tokenizer("the a first second", add_special_tokens=False)["input_ids"]
    batch = {"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask, "n_words": [2], "target_ids": [target]}
    calls = []

    def spy(model, ids, mask, params, *args, **kwargs):
        calls.append(params)
        return speculative_sample(model, ids, mask, params, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler_module, "speculative_sample", spy)
        rolled = module.sampler.rollout(batch, num_generations=2, temperature=0.0)
    return calls, rolled, target


def test_the_sampler_speculates_when_the_settings_ask(make_module):
    module = make_module(sampling={"speculative_tokens": 3, "speculative_ngram": 2}).eval()
    calls, greedy, target = _sampled_with_spy(module)
    assert [call.speculation.sources for call in calls] == [[target]] and calls[0].speculation.max_rows is None
    module.sampler.sampling.speculative_tokens = 0
    calls, plain, _ = _sampled_with_spy(module)
    assert calls == [] and plain.texts == greedy.texts


def test_speculative_max_rows_is_checked_and_reaches_the_draw(make_module):
    with pytest.raises(SettingsError, match="speculative_max_rows must be >= 1"):
        Sampling(speculative_tokens=3, speculative_max_rows=0)
    module = make_module(sampling={"speculative_tokens": 3, "speculative_max_rows": 2}).eval()
    assert [call.speculation.max_rows for call in _sampled_with_spy(module)[0]] == [2]


def test_the_exact_distribution_sums_to_one_over_every_outcome():
    exact = _exact(_small_model(), [1, 2, 3], 3, 1.0, 1.0, 0)
    assert len(exact) == 4**3 + 4**2 + 4 + 1 and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-6)  # float32

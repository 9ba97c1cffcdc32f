"""The sampler: exact against HF generate, prefix sharing, stop tokens and masks, completion texts, budgets."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from interleave_data.prompts import format_prompt
from interleave_model.generation.merged_copy import GROUPED_DECODE
from interleave_model.generation.rollout import (
    _mask_through_stop,
    _pick,
    _uniform,
    answer_budget,
    completion_texts,
    rollout,
    sample,
    token_budget,
)
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.policy import build_tiny_tokenizer, load_pretrained, stop_token_ids

# the sampler on free prompts, checked against HF `generate`, which numbers tokens 0, 1, 2, ...: the stock Llama
pytestmark = pytest.mark.usefixtures("stock_positions")


@pytest.fixture
def tiny(make_module):
    module = make_module()
    prompts = ["A: the first B: a second Interleave:", "A: x B: y z Interleave:"]
    enc = module.tokenizer(prompts, return_tensors="pt", padding=True)
    return module, enc.input_ids, enc.attention_mask


def _sample(module, ids, mask, generator=None, check_every=8, **settings):
    """`sample` of the tiny module's policy: greedy, one answer of 12 tokens a prompt, unless `settings` say more."""
    tok = module.tokenizer
    params = SamplingParams(**{"num_generations": 1, "max_new_tokens": 12, "temperature": 0.0,
                               "stop_ids": [tok.eos_token_id]} | settings)  # fmt: skip
    return sample(module.policy, ids, mask, params, generator, pad_token_id=tok.pad_token_id, check_every=check_every)


def test_greedy_matches_hf_generate_with_left_padding(tiny):
    module, ids, mask = tiny
    assert mask[1, 0] == 0, "the second prompt must be left-padded for this test to mean anything"
    completion, *_ = _sample(module, ids, mask)
    reference = module.policy.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
        pad_token_id=module.tokenizer.pad_token_id, eos_token_id=module.tokenizer.eos_token_id,
    )  # fmt: skip
    assert torch.equal(completion, reference[:, ids.shape[1] :][:, : completion.shape[1]])


def test_shared_prefill_gives_each_group_member_the_unshared_answer(tiny):
    module, ids, mask = tiny
    alone, *_ = _sample(module, ids, mask)
    grouped, *_ = _sample(module, ids, mask, num_generations=3)
    assert grouped.shape[0] == 6
    for g in range(3):
        assert torch.equal(grouped[g::3], alone)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny):
    module, ids, mask = tiny
    draws = [_sample(module, ids, mask, num_generations=4, temperature=1.0, generator=torch.Generator().manual_seed(7))
             for _ in range(2)]  # fmt: skip
    assert torch.equal(draws[0][0], draws[1][0])
    greedy, *_ = _sample(module, ids, mask)
    top1, *_ = _sample(module, ids, mask, temperature=1.0, top_k=1)
    assert torch.equal(top1, greedy)


def test_mask_covers_tokens_through_the_first_of_any_stop_id():
    stops = torch.tensor([7, 9])
    ids = torch.tensor([[5, 9, 0, 0], [5, 6, 4, 8], [9, 0, 0, 0], [5, 7, 9, 9]])
    assert _mask_through_stop(ids, stops).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]


def test_decoding_reads_back_from_the_device_once_every_check(tiny, monkeypatch):
    module, ids, mask = tiny
    reads = []
    for name in ("__bool__", "__int__", "__index__", "__float__", "item", "tolist", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # a stop id never written: every row runs the whole budget of 80 steps, 10 checks at 8 steps each
    completion, *_ = _sample(module, ids, mask, max_new_tokens=80, stop_ids=[-1], check_every=8)
    assert completion.shape[1] == 80
    assert len(reads) <= 80 // 8 + 4  # the checks, plus a few around the loop (the prefill's mask, the results)


class _ScriptedLM(torch.nn.Module):
    """Writes `script[row, step]` as each row's next token, whatever the input (one decode call per step)."""

    def __init__(self, script: torch.Tensor, vocab_size: int):
        super().__init__()
        self.script, self.vocab_size, self.calls = script, vocab_size, 0

    def forward(self, input_ids, **kwargs):
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab_size)
        logits[torch.arange(input_ids.shape[0]), 0, self.script[:, self.calls]] = 1.0
        self.calls += 1
        return SimpleNamespace(logits=logits)


def test_texts_are_the_tokens_before_the_first_stop_and_nothing_else(family_folders):
    _, tok = load_pretrained(str(family_folders["llama3"]))
    eot, eom = tok.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])
    assert tok.pad_token_id == eot and tok.convert_ids_to_tokens(0) == "!"  # the fixture's trap: id 0 decodes as "!"
    a, b = tok("the cat sat", add_special_tokens=False).input_ids, tok("the dog", add_special_tokens=False).input_ids
    width = len(a) + 4
    # row 0 ends at the tokenizer's EOS, row 1 at another stop id (then writes id 0), row 2 runs out of budget
    script = torch.tensor([a + [eot, 5, 6, 7], b + [eom] + [0] * (width - len(b) - 1), a + [8, 9, 10, 11]])
    prompt = torch.tensor([[1, 2], [1, 2], [1, 2]])
    # the script follows the batch's rows, so no row may be retired (no look at finished rows before the end)
    params = SamplingParams(num_generations=1, max_new_tokens=width, stop_ids=[1025, eom, eot], temperature=0.0)
    draw = partial(sample, check_every=width)
    out = rollout(_ScriptedLM(script, len(tok)), tok, prompt, torch.ones_like(prompt), params, draw=draw)
    assert out.texts == ["the cat sat", "the dog", " ".join(tok.decode(a + [8, 9, 10, 11]).split())]
    assert out.completion_mask.sum(-1).tolist() == [len(a) + 1, len(b) + 1, width]  # through the first stop token
    assert (out.completion_ids[1, len(b) + 1 :] == tok.pad_token_id).all()
    assert out.truncated.tolist() == [False, False, True]


def test_texts_keep_special_tokens_inside_the_answer(family_folders):
    _, tok = load_pretrained(str(family_folders["llama3"]))
    header, eot = tok.convert_tokens_to_ids(["<|start_header_id|>", "<|eot_id|>"])
    words = tok("the cat", add_special_tokens=False).input_ids
    ids = torch.tensor([words + [header, eot], words + [eot, header]])
    # the reward sees what the model wrote: a special token inside the answer is part of a word
    assert completion_texts(tok, ids, [eot]) == ["the cat<|start_header_id|>", "the cat"]


def test_texts_keep_the_space_before_punctuation():
    tok = build_tiny_tokenizer([["the", "cat", "."]])
    tok.clean_up_tokenization_spaces = True  # transformers would write "the cat." (it skips this for BPE only)
    ids = torch.tensor([tok("the cat .", add_special_tokens=False).input_ids + [tok.eos_token_id]])
    assert completion_texts(tok, ids, [tok.eos_token_id]) == ["the cat ."]  # "." is a word of the target


@pytest.fixture(params=["llama3", "qwen2", "gpt2"])
def family_policy(request, family_folders):
    """A family's model, tokenizer and stop ids, with a hook that ends row r at decode step r + 1 with its r-th stop id
    (rows past the stop ids never stop), so several stop ids end rows at different steps, as a trained model does."""
    model, tok = load_pretrained(str(family_folders[request.param]))
    stops = stop_token_ids(model, tok)
    step = {"n": 0}

    def count_steps(module, args, output):  # input ids [N, L]: a prefill (L > 1) starts a new answer
        step["n"] = 0 if args[0].shape[1] > 1 else step["n"] + 1

    def end_rows(module, args, logits):  # logits [N, 1, V] of the step's next token
        for row, stop in enumerate(stops):
            if step["n"] == row + 1:
                logits[row, -1, stop] = logits[row, -1].max() + 10.0
        return logits

    model.get_input_embeddings().register_forward_hook(count_steps)
    model.get_output_embeddings().register_forward_hook(end_rows)
    return model, tok, stops


def test_greedy_matches_hf_generate_with_every_stop_id(family_policy):
    model, tok, stops = family_policy
    fragments = [("a b", "c d"), ("one two three four", "x y z w"), ("z", "y"), ("z", "y")]
    texts = [format_prompt(a, b, "compact", tok) for a, b in fragments]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not tok.chat_template)
    ids, mask = enc.input_ids, enc.attention_mask
    params = SamplingParams(num_generations=1, max_new_tokens=8, stop_ids=stops, temperature=0.0)
    completion, completion_mask, truncated, _ = sample(model, ids, mask, params, pad_token_id=tok.pad_token_id)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               eos_token_id=stops, pad_token_id=tok.pad_token_id)[:, ids.shape[1] :]  # fmt: skip
    assert torch.equal(completion, reference[:, : completion.shape[1]])
    ended = list(range(len(stops)))  # each ended at its own stop id, the rest ran out of budget
    assert [completion[row, row + 1].item() for row in ended] == stops
    assert truncated.tolist() == [row >= len(stops) for row in range(4)]
    assert completion_mask.sum(-1).tolist()[: len(stops)] == [row + 2 for row in ended]


def test_the_head_reads_contiguous_hidden_states_in_the_prefill_and_every_step(family_policy):
    # a slice of the prompts' last positions is not contiguous: a CPU linear then copies the head once per prompt
    model, tok, stops = family_policy
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    enc = tok(["the cat sat on", "a", "b c"], return_tensors="pt", padding=True, padding_side="left")
    try:
        sample(model, enc.input_ids, enc.attention_mask, SamplingParams(num_generations=2, max_new_tokens=4,
               stop_ids=[]), torch.Generator().manual_seed(0), pad_token_id=tok.pad_token_id)  # fmt: skip
    finally:
        hook.remove()
    assert [tuple(hidden.shape[:2]) for hidden in seen] == [(3, 1)] + [(6, 1)] * 3  # the prefill keeps one position
    assert all(hidden.is_contiguous() for hidden in seen)


def test_generation_stops_once_every_row_ended(tiny):
    module, ids, mask = tiny
    eos = module.tokenizer.eos_token_id
    with torch.no_grad():  # make EOS the only possible token: every row ends at the first step
        module.policy.lm_head.weight[eos] += 1000.0
    completion, completion_mask, truncated, _ = _sample(module, ids, mask, max_new_tokens=50)
    assert completion.shape[1] == 1 and completion_mask.sum() == 2 and not truncated.any()


def test_truncated_rows_are_flagged_and_texts_decoded(tiny):
    module, ids, mask = tiny
    params = SamplingParams(num_generations=2, max_new_tokens=3, stop_ids=[module.tokenizer.eos_token_id])
    out = rollout(module.policy, module.tokenizer, ids, mask, params)
    assert out.completion_ids.shape == (4, out.completion_mask.shape[1]) and out.prompt_ids.shape[0] == 4
    ended = (out.completion_ids == module.tokenizer.eos_token_id).any(-1)
    assert torch.equal(out.truncated, ~ended)
    assert all(isinstance(t, str) for t in out.texts)


def test_budget_holds_the_longest_target_with_margin():
    # longest target 20 tokens: ceil(20 * 1.25) = 25, + 1 EOS + 4 slack = 30
    assert token_budget([12, 20, 7], margin=0.25, slack=4) == 30
    assert token_budget([1000]) > 2 * token_budget([400])


def test_held_out_budget_is_the_lengths_whatever_the_batch(make_module):
    sampler = make_module().sampler
    short, long = {"n_words": [10, 10], "target_ids": [[1] * 20, [1] * 12]}, {"n_words": [10], "target_ids": [[1] * 45]}

    assert sampler.eval_budget(short) == sampler.eval_budget(long) == answer_budget(10) == 3 * 20 + 8
    # a tokenizer finer than 3 tokens a word gets the training rule's room over its longest target instead
    assert sampler.eval_budget({"n_words": [10], "target_ids": [[1] * 70]}) == token_budget([70]) > answer_budget(10)


def test_an_answer_that_never_stops_is_cut_at_the_held_out_budget(make_module):
    module = make_module().eval()
    module.sampler.stop_ids = []  # nothing stops it
    enc = module.tokenizer(["A: the first B: a second Interleave:"], return_tensors="pt")
    batch = {"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask, "n_words": [4], "target_ids": [[5] * 8]}

    roll = module.sampler.rollout(batch, num_generations=1, temperature=0.0)

    assert roll.completion_ids.shape[1] == answer_budget(4) == 32 and roll.truncated.tolist() == [True]
    assert module.sampler.rollout(batch, 1, 0.0, training=True).completion_ids.shape[1] == token_budget([8])


def _spread_weights(model, std: float = 0.3) -> None:
    """Redraw the fixture's matrices large enough that each prompt gets its own answer (so padding errors show)."""
    seed = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, std, generator=seed)


def _stop_after_tokens_divisible_by(model, stop: int, divisor: int) -> list[int]:
    """Make `stop` the next token of every row whose last input token is a multiple of `divisor`: rows end at steps
    set by their own tokens (not by their place in the batch), so they end at different steps and retiring rows
    changes nothing. Returns the list the rows of every forward are appended to."""
    last, rows = {}, []

    def remember(module, args, output):  # input ids [N, L]
        last["ids"] = args[0][:, -1]
        rows.append(args[0].shape[0])

    def end_rows(module, args, logits):  # logits [N, L, V]
        ends = last["ids"] % divisor == 0  # [N]
        logits[ends, -1, stop] = logits[ends, -1].amax(-1) + 10.0
        return logits

    model.get_input_embeddings().register_forward_hook(remember)
    model.get_output_embeddings().register_forward_hook(end_rows)
    return rows


# grouped_decode: the merged copy's attention, under which the rollout shares each prompt's cache across its group
# (SharedPrefix) until the first retirement writes the per-row layout
@pytest.mark.parametrize("attention", ["sdpa", "eager", GROUPED_DECODE])
def test_greedy_with_left_padding_and_retired_rows_matches_hf_generate(family, attention):
    model, tok = load_pretrained(str(family[1]), attn_implementation=attention)
    _spread_weights(model)
    stops = stop_token_ids(model, tok)
    rows = _stop_after_tokens_divisible_by(model, stops[-1], divisor=13)
    fragments = [("a b", "c d"), ("one two three four five six", "x y z w"), ("z", "y"), ("the cat sat", "on a mat")]
    texts = [format_prompt(a, b, "compact", tok) for a, b in fragments]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not tok.chat_template)
    ids, mask = enc.input_ids, enc.attention_mask
    assert (mask.sum(-1) < ids.shape[1]).sum() >= 2, "prompts of several lengths, left-padded"
    params = SamplingParams(num_generations=2, max_new_tokens=24, stop_ids=stops, temperature=0.0)
    completion, *_ = sample(model, ids, mask, params, pad_token_id=tok.pad_token_id, check_every=2)
    assert min(rows[1:]) < 8, "some rows must have been retired while others ran on"  # rows[0]: the prefill's
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               eos_token_id=stops, pad_token_id=tok.pad_token_id)[:, ids.shape[1] :]  # fmt: skip
    assert len(set(map(tuple, reference.tolist()))) == 4, "every prompt its own answer"
    for g in range(2):
        assert torch.equal(completion[g::2], reference)


def test_retiring_rows_leaves_sampled_answers_unchanged(family_folders):
    model, tok = load_pretrained(str(family_folders["llama3"]))
    _spread_weights(model, std=0.1)
    stops = stop_token_ids(model, tok)
    rows = _stop_after_tokens_divisible_by(model, stops[0], divisor=7)
    enc = tok(["a b c", "x"], return_tensors="pt", padding=True)

    def draw(check_every):
        rows.clear()
        params = SamplingParams(num_generations=4, max_new_tokens=30, stop_ids=stops)
        return sample(model, enc.input_ids, enc.attention_mask, params, torch.Generator().manual_seed(3),
                      pad_token_id=tok.pad_token_id, check_every=check_every)[0]  # fmt: skip

    retired = draw(check_every=2)
    assert min(rows[1:]) < 8, "rows must have been retired"  # rows[0]: the prefill's
    assert len(set(map(tuple, retired.tolist()))) == 8, "every row its own answer"
    assert torch.equal(retired, draw(check_every=30))  # no look before the end: every row runs to the end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 50, 0.9), (0.0, 0, 1.0)]
)
def test_the_sampled_tokens_log_probs_are_the_trainers_scores_and_leave_the_tokens_unchanged(
    dtype, temperature, top_k, top_p
):
    # the log-probs come from the sampling weights when nothing is cut: they must equal log_softmax(logits / T) at the
    # token, with top-k / top-p (scored before the cuts) and greedy, and asking for them must not move the tokens
    torch.manual_seed(0)
    logits = (torch.randn(16, 1000) * 4).to(dtype)
    uniform = _uniform(16, torch.Generator().manual_seed(1), logits.device)
    picked, logprobs = _pick(logits.clone(), temperature, top_p, top_k, uniform, with_logprobs=True)
    alone, none = _pick(logits.clone(), temperature, top_p, top_k, uniform)
    assert torch.equal(picked, alone) and none is None
    expected = (logits.float() / (temperature or 1.0)).log_softmax(-1).gather(-1, picked[:, None])[:, 0]
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected, atol=2e-5, rtol=0)

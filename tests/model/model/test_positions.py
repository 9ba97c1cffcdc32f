"""Coupled positions: the numbers by hand, the sampler and the update agreeing on them, and the runtimes that cannot
pass them refusing such a model in one line."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from interleave_data.prompts import format_prompt
from interleave_model.algorithm.completions import completion_logprobs
from interleave_model.generation.rollout import rollout
from interleave_model.generation.sampler import Sampler
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.policy import PolicyError, build_policy
from interleave_model.model.positions import (
    COUPLED,
    CoupledPositionsError,
    coupled_positions,
    model_positions,
    position_ids,
    refuse_coupled,
)
from interleave_model.settings.policy import TinyModelConfig
from tests.conftest import TINY_SHAPE


def _policy(positions: str, template: str = "compact"):
    return build_policy("tiny", TinyModelConfig(**TINY_SHAPE, positions=positions), None, template, 0)


def test_coupled_positions_by_hand():
    # row 0: A: a1 a2 a3 B: b1 b2 b3 Interleave: | a1 b1 a2 b2 a3 b3 EOS pad       (N = 3, no BOS)
    # row 1: pad pad A: a1 a2 B: b1 b2 Interleave: | a1 b1 a2 b2 EOS pad pad pad   (N = 2, left-padded)
    prompt = torch.tensor([[1] * 9, [0, 0] + [1] * 7])
    answer = torch.tensor([[1] * 7 + [0], [1] * 5 + [0] * 3])
    positions = coupled_positions(torch.cat([prompt, answer], 1), prompt_length=9)
    # A: 1, a_i 2i, B: 2N+2, b_i 2i+1, Interleave: 1, answer word k at k+1, EOS at 2N+2 (where B: sits), pad repeats
    assert positions[0].tolist() == [1, 2, 4, 6, 8, 3, 5, 7, 1] + [2, 3, 4, 5, 6, 7, 8, 8]
    assert positions[1].tolist() == [0, 0, 1, 2, 4, 6, 3, 5, 1] + [2, 3, 4, 5, 6, 6, 6, 6]
    # a BOS first (2N + 4 prompt tokens) takes 0 and moves nothing else
    with_bos = coupled_positions(torch.ones(1, 8, dtype=torch.long), prompt_length=8)
    assert with_bos[0].tolist() == [0, 1, 2, 4, 6, 3, 5, 1]


def test_the_word_to_write_is_always_one_position_ahead():
    """Whatever N, the token written at position p copies the source word at p + 1: the rule has no length in it."""
    for n in (1, 10, 11, 57):
        mask = torch.ones(1, 2 * n + 3 + 2 * n + 1, dtype=torch.long)
        positions = coupled_positions(mask, prompt_length=2 * n + 3)[0].tolist()
        source = {positions[1 + i]: f"a{i + 1}" for i in range(n)} | {
            positions[n + 2 + i]: f"b{i + 1}" for i in range(n)
        }
        source[positions[n + 1]] = "EOS"  # B:
        answer = [w for i in range(n) for w in (f"a{i + 1}", f"b{i + 1}")] + ["EOS"]
        before = [positions[2 * n + 2]] + positions[2 * n + 3 : -1]  # Interleave:, then the answer words before EOS
        assert [source[p + 1] for p in before] == answer


def test_a_prompt_coupled_positions_cannot_number_is_refused():
    with pytest.raises(CoupledPositionsError, match="compact template"):
        coupled_positions(torch.ones(1, 3, dtype=torch.long), prompt_length=3)  # no word at all


def test_only_a_coupled_model_gets_coupled_positions():
    rope, tokenizer, _ = _policy("rope")
    coupled, _, _ = _policy("coupled")
    encoded = tokenizer([format_prompt("a", "b", "compact"), format_prompt("a b", "c d", "compact")], padding=True,
                        return_tensors="pt")  # fmt: skip
    ids, mask = encoded.input_ids, encoded.attention_mask
    assert torch.equal(model_positions(rope, ids, mask), position_ids(mask))
    assert model_positions(coupled, ids, mask).tolist() == [[0, 0, 1, 2, 4, 3, 1], [1, 2, 4, 6, 3, 5, 1]]
    assert coupled.config.position_coupling == COUPLED and not hasattr(rope.config, "position_coupling")


def test_a_prompt_with_its_markers_elsewhere_is_refused():
    """Text after `Interleave:` (or a prompt of another layout) would shift every position silently: the markers are
    checked."""
    coupled, tokenizer, _ = _policy("coupled")
    for prompt in (format_prompt("a b", "c d", "compact") + " a c", "B: a b A: c d Interleave:"):
        encoded = tokenizer([prompt], return_tensors="pt")
        with pytest.raises(CoupledPositionsError, match="markers elsewhere"):
            model_positions(coupled, encoded.input_ids, encoded.attention_mask)


@pytest.mark.parametrize("positions", ["coupled", "rope", "none"])
def test_the_sampler_and_the_update_score_the_same_positions(positions):
    policy, tokenizer, stop_ids = _policy(positions)
    prompts = [format_prompt("a b c", "d e f", "compact"), format_prompt("a b", "d e", "compact")]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    params = SamplingParams(num_generations=3, max_new_tokens=9, stop_ids=stop_ids, with_logprobs=True)
    generator = torch.Generator().manual_seed(0)
    roll = rollout(policy, tokenizer, encoded.input_ids, encoded.attention_mask, params, generator)
    ids = torch.cat([roll.prompt_ids, roll.completion_ids], 1)
    mask = torch.cat([roll.prompt_mask, roll.completion_mask], 1)
    for group_size in (1, 3):  # the full forward, and each prompt forwarded once for its group
        logprobs, _ = completion_logprobs(policy, ids, mask, roll.completion_ids, 1.0, group_size=group_size)
        assert torch.allclose(logprobs, roll.logprobs, atol=1e-5)
    if positions == "coupled":  # the same weights at positions 0, 1, 2, ... score the tokens otherwise
        del policy.config.position_coupling
        plain, _ = completion_logprobs(policy, ids, mask, roll.completion_ids, 1.0)
        assert (plain - roll.logprobs).abs().max() > 1e-4


def test_a_coupled_model_saves_and_loads_as_coupled(tmp_path):
    policy, tokenizer, _ = _policy("coupled")
    policy.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.position_coupling == COUPLED
    assert loaded.config.coupling_markers == policy.config.coupling_markers
    encoded = tokenizer([format_prompt("a b", "c d", "compact") + " a c b d"], return_tensors="pt")
    answer = encoded.input_ids[:, -4:]  # scored as the answer to the prompt before it
    scored = [completion_logprobs(m.eval(), encoded.input_ids, encoded.attention_mask, answer, 1.0)[0]
              for m in (policy, loaded)]  # fmt: skip
    torch.testing.assert_close(scored[0], scored[1])


def test_runtimes_that_number_tokens_themselves_refuse_a_coupled_model():
    policy, tokenizer, stop_ids = _policy("coupled")
    with pytest.raises(CoupledPositionsError, match="model.rollout_engine: vllm numbers tokens 0, 1, 2"):
        Sampler(policy, tokenizer, stop_ids, engine="vllm")
    refuse_coupled(_policy("rope")[0], "vLLM")  # a stock model passes


def test_coupled_positions_need_the_compact_template():
    with pytest.raises(PolicyError, match="data.template is 'two_processes': set it to compact"):
        _policy("coupled", template="two_processes")


def test_a_saved_coupled_folder_tests_with_the_compact_template_and_refuses_another(tmp_path, capsys):
    from cli import run
    from tests.conftest import TINY_CONFIG

    policy, tokenizer, _ = _policy("coupled")
    policy.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    common = ["test", "--config", str(TINY_CONFIG), f"--model.base.name_or_path={tmp_path / 'model'}",
              f"--trainer.default_root_dir={tmp_path}", "--data.eval_stages=[4]", "--data.test_pairs=2"]  # fmt: skip
    assert run(common) == 0
    capsys.readouterr()
    assert run([*common, "--data.template=two_processes"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "set data.template: compact" in errors[0]

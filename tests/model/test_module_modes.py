"""Train mode for updates, eval mode for sampling, no dropout by default, gradient checkpointing that recomputes.

On real-family folders loaded from disk (tests/families.py): `from_pretrained` returns a model in eval mode.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import interleave_model.algorithm.completions as completions_py
import interleave_model.algorithm.update as update_py
import interleave_model.generation.sampler as sampler_py
from interleave_model.algorithm import grpo
from interleave_model.model.policy import LoraSettings, frozen_copy
from interleave_model.module import InterleaveGRPO
from tests.conftest import fit_one_grpo_step


def _module(folder, lora=None, base=None, sampling=None, loss=None, kl=None, optimization=None) -> InterleaveGRPO:
    return InterleaveGRPO(
        base={"name_or_path": str(folder)} | (base or {}), template="compact", lora=lora,
        sampling={"num_generations": 2} | (sampling or {}), loss=loss or {}, kl={"beta": 0.0} | (kl or {}),
        optimization=optimization or {},
    )  # fmt: skip


def _count_forwards(layer: torch.nn.Module) -> list[bool]:
    """Wrap `layer.forward` to record grad mode at each call (a checkpoint's recompute runs no forward hooks)."""
    calls, forward = [], layer.forward

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return forward(*args, **kwargs)

    layer.forward = counting
    return calls


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4)], ids=["full", "lora"])
def test_updates_run_in_train_mode_sampling_and_the_reference_in_eval_mode(
    family_folders, make_datamodule, monkeypatch, lora
):
    module = _module(family_folders["llama3"], lora=lora, kl={"beta": 0.04}, base={"disable_dropout": False})
    if lora is None:
        module.reference = frozen_copy(module.policy)  # as a resumed run has it, in eval mode
    modes = {"rollout": [], "reference": [], "update": []}
    rollout, logprobs = sampler_py.rollout, update_py.completion_logprobs

    def recording_rollout(model, *args, **kwargs):
        modes["rollout"].append(model.training)
        return rollout(model, *args, **kwargs)

    def recording_logprobs(model, *args, **kwargs):
        modes["update" if torch.is_grad_enabled() else "reference"].append(model.training)
        return logprobs(model, *args, **kwargs)

    monkeypatch.setattr(sampler_py, "rollout", recording_rollout)
    monkeypatch.setattr(update_py, "completion_logprobs", recording_logprobs)  # the update
    monkeypatch.setattr(completions_py, "completion_logprobs", recording_logprobs)  # the reference (and old log-probs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_one_grpo_step(module, make_datamodule)

    assert modes == {"rollout": [False], "reference": [False], "update": [True]}
    assert not [w for w in caught if "eval mode at the start of training" in str(w.message)]


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_first_ratio_is_exactly_one_without_dropout(family_folders, make_datamodule, monkeypatch, disable_dropout):
    """GPT-2's config has dropout 0.1: on in train mode unless disabled, and then the ratio is noise from step one.

    The fixture's random weights put all the mass on one token (log-prob 0, whatever dropout does); a high
    temperature spreads it.
    """
    module = _module(
        family_folders["gpt2"],
        loss={"num_iterations": 2},
        base={"disable_dropout": disable_dropout},
        sampling={"temperature": 20.0},
    )
    assert module.policy.config.resid_pdrop == module.policy.config.attn_pdrop == 0.1
    calls = []
    policy_loss = grpo.policy_loss

    def recording_policy_loss(logprobs, old, *args, **kwargs):
        out = policy_loss(logprobs, old, *args, **kwargs)
        calls.append((logprobs.detach(), old, out.clip_frac))
        return out

    monkeypatch.setattr(grpo, "policy_loss", recording_policy_loss)
    fit_one_grpo_step(module, make_datamodule)

    assert len(calls) == 2  # num_iterations updates of one rollout
    logprobs, old, clip_frac = calls[0]
    assert (logprobs < -0.1).any()
    if disable_dropout:
        assert torch.equal(logprobs, old) and clip_frac == 0  # ratio exp(0) == 1, bitwise
    else:
        assert not torch.equal(logprobs, old)  # dropout acts: the update is in train mode


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4)], ids=["full", "lora"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "plain"])
def test_gradient_checkpointing_recomputes_each_layer(family_folders, make_datamodule, lora, checkpointing):
    """A layer runs twice on the same input per update with checkpointing (forward, then again in the backward), once
    without (where a group's prompt and its completions are two forwards of different shapes)."""
    module = _module(family_folders["llama3"], lora=lora, base={"gradient_checkpointing": checkpointing})
    layer = next(m for m in module.policy.modules() if type(m).__name__ == "LlamaDecoderLayer")
    shapes, forward = [], layer.forward

    def recording(hidden_states, *args, **kwargs):
        if torch.is_grad_enabled():  # the rollout's forwards run without grad
            shapes.append(tuple(hidden_states.shape))
        return forward(hidden_states, *args, **kwargs)

    layer.forward = recording

    fit_one_grpo_step(module, make_datamodule)

    if checkpointing:
        assert len(shapes) == 2 and shapes[0] == shapes[1], shapes
    else:
        assert len(shapes) == 2 and shapes[0] != shapes[1], shapes  # [P, Lp, H], then [P*G, C-1, H]

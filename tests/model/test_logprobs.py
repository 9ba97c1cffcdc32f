"""Completion log-probs on each real family: the fused LM head where it applies, the logits elsewhere, same values."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from interleave_model.logprobs import completion_logits, completion_logprobs, fused_head, token_entropy, token_logprobs
from interleave_model.policy import LoraSettings, apply_lora

FUSED = {"llama3": True, "qwen2": True, "gpt2": False}  # GPT-2 is not on the list of plain heads: logits path


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fused_head_gives_the_logits_path_values(family, lora):
    name, folder = family
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    if lora:
        model = apply_lora(model, LoraSettings(r=4, dropout=0.0))
        for p in model.parameters():
            if p.requires_grad:  # a trained adapter, not the zero update of a fresh one
                torch.nn.init.normal_(p, std=0.1)
    assert (fused_head(model) is not None) == FUSED[name]
    input_ids = torch.randint(0, 1000, (3, 9))  # [N, Lp+C]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding
    attention_mask[1, -2:] = 0  # a completion that stopped early
    completion = input_ids[:, -4:]  # [N, C]

    logprobs, entropy = completion_logprobs(model, input_ids, attention_mask, completion, 0.7, with_entropy=True)

    logits = completion_logits(model, input_ids, attention_mask, width=4)  # [N, C, V]
    keep = attention_mask[:, -4:].bool()  # [N, C]
    expected = token_logprobs(logits, completion, 0.7)  # [N, C]
    torch.testing.assert_close(logprobs[keep], expected[keep], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(entropy[keep], token_entropy(logits, 0.7)[keep], rtol=1e-5, atol=1e-4)

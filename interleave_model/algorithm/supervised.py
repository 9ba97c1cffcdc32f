"""The supervised warm-start's inputs: prompt + target + EOS, labelled on the target and EOS tokens."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase


def sft_inputs(tokenizer: PreTrainedTokenizerBase, batch: dict, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt + target + EOS, right-padded after the target; labels are -100 except on target and EOS tokens.

    Returns:
        input_ids [B, Lp+T], attention_mask [B, Lp+T] and labels [B, T], the last T positions of each row, as
        `completions.completion_logits(..., width=T)` predicts them.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    answers = [ids + [eos] for ids in batch["target_ids"]]
    width = max(len(a) for a in answers)
    answer_ids = torch.full((len(answers), width), pad, dtype=torch.long)  # [B, T]
    labels = torch.full((len(answers), width), -100, dtype=torch.long)  # [B, T]
    for i, answer in enumerate(answers):
        answer_ids[i, : len(answer)] = torch.tensor(answer)
        labels[i, : len(answer)] = torch.tensor(answer)
    answer_ids, labels = answer_ids.to(device), labels.to(device)
    input_ids = torch.cat([batch["prompt_ids"], answer_ids], dim=1)  # [B, Lp+T]
    attention_mask = torch.cat([batch["prompt_mask"], (labels != -100).long()], dim=1)  # [B, Lp+T]
    return input_ids, attention_mask, labels

"""Log-probs of a completion under a model: through the fused LM head when it has a plain one, else its logits."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from interleave_model import grpo
from interleave_model.rollout import position_ids


def completion_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, width: int) -> Tensor:
    """Logits that predict the last `width` tokens of each row (the completion), [N, width, V]."""
    positions = position_ids(attention_mask)  # [N, L]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        logits_to_keep=width + 1,
        use_cache=False,  # else the forward keeps a copy of every layer's keys and values
    )
    return out.logits[:, :-1]  # position t predicts token t+1, so drop the last


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_ids: Tensor,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the completion (the last C tokens of each row) and, when asked, the entropies: [N, C] each.

    Through the fused LM head (`grpo.head_token_logprobs`) when the model has a plain one: only the completion
    tokens go through the head, and no [N, C, V] logits (nor their gradient) are ever held; positions past the
    completion mask get 0. Otherwise from the model's logits.
    """
    width = completion_ids.shape[1]
    head = fused_head(model)
    if head is None:
        logits = completion_logits(model, input_ids, attention_mask, width)  # [N, C, V]
        entropy = grpo.token_entropy(logits.detach(), temperature) if with_entropy else None  # [N, C]
        return grpo.token_logprobs(logits, completion_ids, temperature), entropy
    decoder, weight = head
    positions = position_ids(attention_mask)  # [N, L]
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
    ).last_hidden_state  # [N, L, H]
    keep = attention_mask[:, -width:].bool()  # [N, C], the completion mask
    scored = hidden[:, -width - 1 : -1][keep]  # [K, H]: position t predicts token t+1
    logprobs, entropy = grpo.head_token_logprobs(
        scored, weight, completion_ids[keep], temperature, with_entropy=with_entropy
    )  # [K] each
    logprobs = torch.zeros_like(keep, dtype=logprobs.dtype).masked_scatter(keep, logprobs)  # [N, C]
    if entropy is not None:
        entropy = torch.zeros_like(keep, dtype=entropy.dtype).masked_scatter(keep, entropy)  # [N, C]
    return logprobs, entropy


def fused_head(model: torch.nn.Module) -> tuple[torch.nn.Module, Tensor] | None:
    """(decoder, LM-head weight) of a model whose logits are exactly `decoder(...) @ weight.T`, else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in ("llama", "mistral", "qwen2", "qwen3"):
        return None  # other families may cap, scale or bias their logits
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or type(head.weight) is not torch.nn.Parameter:
        return None  # an adapter on the head, or a sharded (DTensor) weight
    return model.get_decoder(), head.weight


def sft_inputs(tokenizer: PreTrainedTokenizerBase, batch: dict, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt + target + EOS, right-padded after the target; labels are -100 except on target and EOS tokens.

    Returns:
        input_ids [B, Lp+T], attention_mask [B, Lp+T] and labels [B, T], the last T positions of each row, as
        `completion_logits(..., width=T)` predicts them.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    answers = [ids + [eos] for ids in tokenizer(batch["targets"], add_special_tokens=False)["input_ids"]]
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

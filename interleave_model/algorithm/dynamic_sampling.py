"""Dynamic sampling (DAPO): groups whose rewards are all equal leave the batch; groups from extra prompts refill it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from interleave_model.algorithm import grpo
from interleave_model.algorithm.records import Trajectory
from interleave_model.generation.rollout import Rollout
from interleave_model.settings.sampling import DynamicSampling as DynamicSampling  # checkpoints, configs name it here


def refill(
    trajectory: Trajectory,
    generate: Callable[[dict], Trajectory],
    draw: Callable[[int, int], dict],
    num_generations: int,
    max_rounds: int,
    pad_token_id: int,
) -> tuple[Trajectory, dict[str, float]]:
    """Drop the zero-variance groups of `trajectory` and refill from extra prompts, up to `max_rounds` rounds.

    Args:
        trajectory: The batch's trajectory, group-major.
        generate: Rolls out and scores a batch of extra prompts (the module's `generate_trajectory`).
        draw: `draw(round, n)` gives `n` extra prompts for refill round `round`, as a batch on the policy's device.
            A GRPO batch carries it (`refill`: the DataModule's `sample_refill` for that batch), seeded by the
            batch index and the round, so a resumed run draws the same ones; replayed rows of earlier stages are
            refilled at the batch's stage.
        num_generations: Completions per prompt (G).
        max_rounds: Refill rounds at most (`DynamicSampling.max_rounds`).
        pad_token_id: Pads the parts to one width when they are stacked.

    Returns:
        The trajectory to train on, as many groups as `trajectory`, and counters: groups dropped, refill rounds
        run, groups kept with some reward variance.
    """
    G = num_generations
    n_groups = trajectory.rewards.numel() // G
    parts, kept, dropped, rounds = [], 0, 0, 0
    current = trajectory
    while True:
        flat = grpo.zero_std_groups(current.rewards, G)  # [P']
        dropped += int(flat.sum())
        keep = ~flat & (torch.cumsum(~flat, 0) <= n_groups - kept)  # a refill may bring more than are missing
        if keep.any():
            parts.append(select_groups(current, keep, G))
            kept += int(keep.sum())
        if kept >= n_groups or rounds >= max_rounds:
            break
        current = generate(draw(rounds, n_groups - kept))
        rounds += 1
    stats = {"train/dynamic_dropped_groups": float(dropped), "train/dynamic_rounds": float(rounds)}
    stats["train/dynamic_kept_groups"] = float(kept)
    if not parts:
        return trajectory, stats
    if kept < n_groups:  # at the cap: top up with the batch's own flat groups
        flat = grpo.zero_std_groups(trajectory.rewards, G)  # [P]
        parts.append(select_groups(trajectory, flat & (torch.cumsum(flat, 0) <= n_groups - kept), G))
    return concat(parts, pad_token_id), stats


def select_groups(trajectory: Trajectory, keep: Tensor, num_generations: int) -> Trajectory:
    """The rows of the groups where `keep` [P] is set, every field sliced alike."""
    rows = keep.repeat_interleave(num_generations).nonzero().squeeze(-1)  # [P'*G]
    return _map_rows(trajectory, lambda value: value[rows])


def _map_rows(record, fn):
    fields = {}
    for name, value in record._asdict().items():
        if isinstance(value, Tensor):
            fields[name] = fn(value)
        elif isinstance(value, Rollout):
            fields[name] = _map_rows(value, fn)
        elif isinstance(value, list):
            index = fn(torch.arange(len(value))).tolist()
            fields[name] = [value[i] for i in index]
        else:
            fields[name] = value
    return type(record)(**fields)


def concat(parts: list[Trajectory], pad_token_id: int) -> Trajectory:
    """Stack trajectories row-wise: prompts left-padded and completions right-padded to the widest part."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)  # C
    prompt_width = max(p.input_ids.shape[1] - p.completion_ids.shape[1] for p in parts)  # Lp

    def sequences(field: str, value: int) -> Tensor:  # [N, Lp+C] = left-padded prompt | right-padded completion
        out = []
        for p in parts:
            x, c = getattr(p, field), p.completion_ids.shape[1]
            prompt, completion = x[:, : x.shape[1] - c], x[:, x.shape[1] - c :]
            prompt = F.pad(prompt, (prompt_width - prompt.shape[1], 0), value=value)
            out.append(torch.cat([prompt, F.pad(completion, (0, width - c), value=value)], dim=1))
        return torch.cat(out)

    def right(values: list[Tensor | None], value: float) -> Tensor | None:  # [N, widest], e.g. [N, C]
        if values[0] is None:
            return None
        widest = max(v.shape[1] for v in values)
        return torch.cat([F.pad(v, (0, widest - v.shape[1]), value=value) for v in values])

    rollouts = [p.rollout for p in parts]
    rollout = Rollout(
        prompt_ids=torch.cat([F.pad(r.prompt_ids, (prompt_width - r.prompt_ids.shape[1], 0), value=pad_token_id)
                              for r in rollouts]),
        prompt_mask=torch.cat([F.pad(r.prompt_mask, (prompt_width - r.prompt_mask.shape[1], 0)) for r in rollouts]),
        completion_ids=right([r.completion_ids for r in rollouts], pad_token_id),
        completion_mask=right([r.completion_mask for r in rollouts], 0),
        truncated=torch.cat([r.truncated for r in rollouts]),
        texts=[t for r in rollouts for t in r.texts],
        logprobs=right([r.logprobs for r in rollouts], 0.0),
    )  # fmt: skip
    return type(parts[0])(
        input_ids=sequences("input_ids", pad_token_id),
        attention_mask=sequences("attention_mask", 0),
        completion_ids=rollout.completion_ids,
        completion_mask=rollout.completion_mask,
        old_logprobs=right([p.old_logprobs for p in parts], 0.0),
        ref_logprobs=right([p.ref_logprobs for p in parts], 0.0),
        rewards=torch.cat([p.rewards for p in parts]),
        advantages=None,  # made for the batch as refilled
        rollout=rollout,
    )

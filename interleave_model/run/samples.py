"""Sampled completions: `SampleDump` writes a step's best and worst; `sample_markdown` shows one in TensorBoard.

TensorBoard's text tab renders markdown, where a prompt's own newlines, `#` or `*` would turn into prose and
headings. Each text is an indented code block (every line indented, so nothing in it is markdown), and the
completion's first word that departs from the target is set in ⟦ ⟧ (the alignment's `first_error`: the length of
the common word prefix).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from interleave_model.evaluation.alignment import align
from interleave_model.run.runs import run_dir

MARK_OPEN, MARK_CLOSE = "⟦", "⟧"


def mark_first_departure(completion: str, first_error: int) -> str:
    """The completion with its word at index `first_error` in ⟦ ⟧, or ⟦⟧ at its end when it stops before it.

    Everything else, whitespace included, is kept as it was.
    """
    spans = [m.span() for m in re.finditer(r"\S+", completion)]
    if first_error < len(spans):
        start, end = spans[first_error]
        return f"{completion[:start]}{MARK_OPEN}{completion[start:end]}{MARK_CLOSE}{completion[end:]}"
    return f"{completion}{MARK_OPEN}{MARK_CLOSE}"


def departure(completion: str, target: str) -> tuple[int | None, str]:
    """Where the completion first departs from the target: (word index or None when equal, a sentence saying so)."""
    first_error = align(completion, target).first_error
    said, wanted = completion.split(), target.split()
    if said == wanted:
        return None, "matches the target"
    if first_error >= len(said):
        return first_error, f"stops after word {first_error} of the target's {len(wanted)}"
    if first_error >= len(wanted):
        return first_error, f"goes on after the target's {len(wanted)} words with `{said[first_error]}`"
    return first_error, (
        f"departs from the target at word {first_error + 1} of {len(wanted)}: `{said[first_error]}` where the "
        f"target has `{wanted[first_error]}`"
    )


def sample_markdown(head: str, prompt: str, target: str, completion: str) -> str:
    """One sample for TensorBoard's text tab: a bold head, then prompt, target and marked completion as code."""
    first_error, where = departure(completion, target)
    shown = completion if first_error is None else mark_first_departure(completion, first_error)
    mark = "" if first_error is None else f", marked {MARK_OPEN} {MARK_CLOSE}"
    parts = [f"**{head}**", "prompt:", _code(prompt), "target:", _code(target), f"completion ({where}{mark}):"]
    parts.append(_code(shown))
    return "\n\n".join(parts)


def _code(text: str) -> str:
    """An indented code block: markdown leaves every character of it as it is."""
    return "\n".join(f"    {line}" for line in (text.splitlines() or [""]))


class SampleDump(L.Callback):
    """Every `every_n_steps` GRPO batches, the best and the worst completion of the batch over all ranks.

    Written by rank 0 to `<run>/<filename>` (appended, so a resumed run adds to it) and to TensorBoard text:
    prompt, target, completion, reward and the first-error position (the target word where the completion first
    departs from it); in TensorBoard each text is whole and the departing word is marked (`samples.sample_markdown`).

    Args:
        every_n_steps: Batches between dumps.
        filename: Log file name inside the run folder.
    """

    def __init__(self, every_n_steps: int = 50, filename: str = "samples.log") -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.filename = filename
        self.path: Path | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.path = run_dir(trainer) / self.filename

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = outputs.get("record") if isinstance(outputs, Mapping) else None
        if record is None or (batch["batch_index"] + 1) % self.every_n_steps:
            return
        rewards = record.rewards.detach().float().cpu().tolist()  # [P*G]
        G = record.num_generations
        ends = [max(range(len(rewards)), key=rewards.__getitem__), min(range(len(rewards)), key=rewards.__getitem__)]
        local = [
            (rewards[i], record.prompts[i // G], record.targets[i // G], record.completions[i], record.n_words[i // G])
            for i in ends
        ]
        candidates = _gather_objects(local, trainer)
        if trainer.is_global_zero:
            best = max(candidates, key=lambda c: c[0])
            worst = min(candidates, key=lambda c: c[0])
            self._write(trainer, [("best", *best), ("worst", *worst)])

    def _write(self, trainer: L.Trainer, samples: list[tuple]) -> None:
        step, lines, markdown = trainer.global_step, [], []
        for name, reward, prompt, target, completion, n_words in samples:
            first_error, n_target = align(completion, target).first_error, len(target.split())
            head = f"{name}: reward {reward:.3f}, first error at word {first_error}/{n_target}, {n_words} words"
            lines += [f"=== step {step} {head}", f"prompt: {prompt}", f"target: {target}", f"completion: {completion}"]
            markdown.append(sample_markdown(f"step {step} {head}", prompt, target, completion))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(line.replace("\n", "\\n") for line in lines) + "\n\n")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("samples", "\n\n---\n\n".join(markdown), step)


def _gather_objects(obj, trainer: L.Trainer) -> list:
    """Every rank's list `obj`, concatenated in rank order (just `obj` on one process)."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return list(obj)
    gathered = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, obj)
    return [item for part in gathered for item in part]

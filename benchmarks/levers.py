"""The levers tried on the CPU tiny model that are not settings of the project: position schemes and base models.

Plain torch (no Lightning), so a lever costs minutes, not a run; held-out scores are greedy alignment scores on pairs
of validation texts, as the project measures them. Each command prints one JSON line; `--out` saves the model with
its tokenizer (a `from_pretrained` folder that `benchmarks/efficacy.py --start` takes).

    python benchmarks/levers.py positions --arch rope            # interleave SFT on 2..10 words: length transfer
    python benchmarks/levers.py copy-base --arch local-rope      # a base pretrained to copy, never to interleave
    python benchmarks/levers.py related-base --out bases/related # repeat / concatenate / pairs / triples, no interleave
    python benchmarks/levers.py sft --start bases/related --words 10 --steps 60 --every 10 --out starts/related

Architectures (all transformers families that vLLM serves): `rope` is the project's tiny Llama; `nope` is SmolLM3
with no RoPE in any layer; `local-rope` is Cohere2 with RoPE on sliding-window layers (window 8) and none on the full
ones, alternating. Every model has the tiny model's frozen random embeddings (std 0.1), 4 layers, 128 wide.
Measured: docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import Counter
from pathlib import Path

import harness
import torch
import torch.nn.functional as F
from provenance import provenance
from tokenizers.processors import TemplateProcessing

from interleave_data.corpus import load_corpus
from interleave_data.pairs import build_examples, interleave, split_texts
from interleave_data.prompts import format_prompt
from interleave_model.evaluation.alignment import score_batch
from interleave_model.generation.rollout import rollout
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.policy import build_tiny_tokenizer

# instruction words of the base models' tasks; "Interleave:" is the compact template's own
INSTRUCTIONS = {"repeat_a": ["Repeat", "A:"], "repeat_b": ["Repeat", "B:"], "concatenate": ["Concatenate:"],
                "pairs": ["Pairs:"], "triples": ["Triples:"], "copy": ["Copy:"]}  # fmt: skip
CHUNK = {"concatenate": None, "pairs": 2, "triples": 3}  # words of one fragment before the other's turn


class Tasks:
    """Training texts of the project's split (seed 0), the tokenizer, and the tasks built from them."""

    def __init__(self, random_share: float = 0.0):
        corpus = load_corpus(None)
        self.splits = split_texts(corpus.texts, seed=0)
        extra = format_prompt("", "", "compact").split() + [w for ws in INSTRUCTIONS.values() for w in ws]
        self.tokenizer = build_tiny_tokenizer([t.words for t in corpus.texts], extra_words=extra)
        bos = self.tokenizer.bos_token_id  # a pretrained base opens every prompt with BOS
        self.tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
        self.vocab = self.tokenizer.get_vocab()
        self.train = [list(t.words) for t in self.splits["train"]]
        counts = Counter(w for t in self.train for w in t)  # training words at their frequency: real repeats
        self.unigram, self.weights = list(counts), list(counts.values())
        self.random_share = random_share

    def span(self, rng: random.Random, n: int) -> list[str]:
        """`n` words: a window of a training text, or (with `random_share`) training words drawn at random."""
        if self.random_share and rng.random() < self.random_share:
            return rng.choices(self.unigram, self.weights, k=n)
        text = rng.choice([t for t in self.train if len(t) >= n])
        start = rng.randrange(len(text) - n + 1)
        return text[start : start + n]

    def example(self, rng: random.Random, kind: str, n: int) -> tuple[list[str], list[str]]:
        """(prompt words, answer words) of one task with fragments of `n` words."""
        a, b = self.span(rng, n), self.span(rng, n)
        return prompt_and_answer(kind, a, b)

    def ids(self, words: list[str]) -> list[int]:
        return [self.vocab[w] for w in words]


def prompt_and_answer(kind: str, a: list[str], b: list[str]) -> tuple[list[str], list[str]]:
    """The task `kind` on fragments `a` and `b`: the compact template with its last word replaced by the task's."""
    prompt = format_prompt(" ".join(a), " ".join(b), "compact").split()
    if kind == "interleave":
        return prompt, interleave(a, b)
    if kind == "copy":
        return ["A:", *a, *INSTRUCTIONS["copy"]], a
    prompt = prompt[:-1] + INSTRUCTIONS[kind]
    if kind in ("repeat_a", "repeat_b"):
        return prompt, a if kind == "repeat_a" else b
    k = CHUNK[kind] or len(a)
    return prompt, [w for i in range(0, len(a), k) for w in a[i : i + k] + b[i : i + k]]


def build_model(arch: str, vocab_size: int, tokenizer, seed: int):
    """A 4-layer, 128-wide model of `arch` with the tiny model's frozen random embeddings."""
    from transformers import (
        Cohere2Config,
        Cohere2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )  # fmt: skip

    shape = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=8192, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    if arch == "rope":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif arch == "nope":
        model = SmolLM3ForCausalLM(SmolLM3Config(**shape, no_rope_layers=[0] * 4, use_sliding_window=False))
    elif arch == "local-rope":  # Cohere2: RoPE only on its sliding-window layers
        types = ["sliding_attention", "full_attention"] * 2
        model = Cohere2ForCausalLM(Cohere2Config(**shape, layer_types=types, sliding_window=8, logit_scale=1.0))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=0.1)
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def batch(tasks: Tasks, rng: random.Random, kinds: list[str], lengths: list[int], size: int, same_length: bool):
    """Input ids, attention mask and labels (-100 but on the answer and its EOS), right-padded."""
    n_batch = rng.choice(lengths)
    rows = []
    for _ in range(size):
        prompt, answer = tasks.example(rng, rng.choice(kinds), n_batch if same_length else rng.choice(lengths))
        bos, eos = tasks.tokenizer.bos_token_id, tasks.tokenizer.eos_token_id
        rows.append(([bos, *tasks.ids(prompt)], [*tasks.ids(answer), eos]))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((size, width), tasks.tokenizer.pad_token_id)
    mask, labels = torch.zeros((size, width), dtype=torch.long), torch.full((size, width), -100)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)], mask[i, : len(p) + len(a)] = torch.tensor(p + a), 1
        labels[i, len(p) - 1 : len(p) + len(a) - 1] = torch.tensor(a)  # position t predicts token t + 1
    return ids, mask, labels


@torch.no_grad()
def held_out(model, tasks: Tasks, kind: str, lengths: list[int], pairs: int = 32) -> dict[int, float]:
    """Greedy alignment score of task `kind` on validation pairs (the project's `val` examples, seed 0)."""
    model.eval()
    scores = {}
    for n in lengths:
        examples = build_examples(tasks.splits["val"], n, pairs, 0, "val")
        cases = [prompt_and_answer(kind, e.a.split(), e.b.split()) for e in examples]
        encoded = tasks.tokenizer([" ".join(p) for p, _ in cases], padding=True, return_tensors="pt")
        params = SamplingParams(num_generations=1, max_new_tokens=math.ceil(2 * n * 1.25) + 5,
                                stop_ids=[tasks.tokenizer.eos_token_id], temperature=0.0)  # fmt: skip
        out = rollout(model, tasks.tokenizer, encoded["input_ids"], encoded["attention_mask"], params)
        found = score_batch(out.texts, [" ".join(a) for _, a in cases])
        scores[n] = round(sum(found) / len(found), 3)
    model.train()
    return scores


def train(model, tasks, kinds, lengths, steps, lr, seed, evaluate, every, same_length, warmup, floor):
    """AdamW on the answer tokens: linear warm-up, then a cosine down to `floor` of `lr` (1.0: flat); `evaluate(step)`
    every `every` steps. With `same_length` every batch has one fragment length (no padding spent)."""
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    curve = []
    for step in range(steps):
        cosine = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * cosine
        ids, mask, labels = batch(tasks, rng, kinds, lengths, 32, same_length)
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # [B, L, H]
        answer = labels != -100  # [B, L]
        logits = model.lm_head(hidden[answer]) * getattr(model.config, "logit_scale", 1.0)  # [T, V]
        loss = F.cross_entropy(logits.float(), labels[answer])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if every and (step + 1) % every == 0:
            curve.append({"step": step + 1, "loss": round(loss.item(), 3), **evaluate(step + 1)})
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lever", choices=["positions", "copy-base", "related-base", "sft"])
    parser.add_argument("--arch", default="rope", choices=["rope", "nope", "local-rope"])
    parser.add_argument("--start", default=None, help="sft: a model folder to start from (default: a new --arch)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--words", type=int, nargs="+", default=None, help="training lengths (default per lever)")
    parser.add_argument("--max-words", type=int, default=48, help="copy-base: lengths 2 .. this")
    parser.add_argument("--random-share", type=float, default=0.0, help="copy-base: share of random-word fragments")
    parser.add_argument("--every", type=int, default=None, help="steps between held-out evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="save the model here (sft: one folder per evaluation)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tasks = Tasks(args.random_share)
    started = time.perf_counter()
    lever, interleave_at = args.lever, [10, 15, 25, 50]
    if lever == "sft" and args.start:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.start)
        model.get_input_embeddings().weight.requires_grad_(False)
    else:
        model = build_model(args.arch, len(tasks.tokenizer), tasks.tokenizer, args.seed)
    # each lever's task mix, lengths, steps, rate and schedule (warm-up, floor of the cosine; a floor of 1 is flat)
    if lever == "positions":  # interleave SFT on 2..10 words: does it carry past 10?
        kinds, lengths, steps, lr, schedule = ["interleave"], args.words or list(range(2, 11)), 2000, 2e-3, (50, 0.0)
        evaluate = lambda step: {"interleave": held_out(model, tasks, "interleave", interleave_at)}  # noqa: E731
    elif lever == "copy-base":  # copy a fragment (or both, in turn), at every length up to --max-words
        kinds, steps, lr, schedule = ["repeat_a", "repeat_b", "copy"], 3000, 3e-3, (50, 0.1)
        lengths = args.words or list(range(2, args.max_words + 1))
        at = [10, 25, args.max_words, 2 * args.max_words]
        evaluate = lambda step: {  # noqa: E731
            "repeat_a": held_out(model, tasks, "repeat_a", at),
            "interleave": held_out(model, tasks, "interleave", [10]),
        }
    elif lever == "related-base":  # two-fragment tasks that are not interleaving
        kinds, steps, lr, schedule = ["repeat_a", "repeat_b", "concatenate", "pairs", "triples"], 2400, 2e-3, (20, 1.0)
        lengths = args.words or list(range(2, 11))
        evaluate = lambda step: {k: held_out(model, tasks, k, [10]) for k in ["interleave", *kinds]}  # noqa: E731
    else:  # interleave SFT from --start or from scratch, saving a folder at each evaluation
        kinds, lengths, steps, lr, schedule = ["interleave"], args.words or [10], 800, 2e-3, (20, 1.0)

        def evaluate(step: int) -> dict:
            if args.out:
                save(model, tasks, Path(f"{args.out}-{step}"))
            return {"interleave": held_out(model, tasks, "interleave", [10, 20])}

    steps, lr = args.steps or steps, args.lr or lr
    every = args.every or max(1, steps // 8)
    same_length = lever == "copy-base"
    curve = train(model, tasks, kinds, lengths, steps, lr, args.seed, evaluate, every, same_length, *schedule)
    if args.out and lever != "sft":
        save(model, tasks, Path(args.out))
    harness.emit({
        "benchmark": "levers", "lever": lever, "arch": args.arch, "start": args.start, "steps": steps, "lr": lr,
        "lengths": [min(lengths), max(lengths)], "random_share": args.random_share, "seed": args.seed,
        "curve": curve, "seconds": round(time.perf_counter() - started, 1), **provenance(),
    })  # fmt: skip


def save(model, tasks: Tasks, folder: Path) -> None:
    model.save_pretrained(folder)
    tasks.tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    main()

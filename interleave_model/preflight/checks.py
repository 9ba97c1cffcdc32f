"""Check a model against the curriculum before any training step: every problem found is one `PolicyError` line.

The module runs `preflight` when fit / validate / test / predict set up, so a model that cannot do the task fails in
seconds, not after the warm-start; `python cli.py check` prints the same checks with what was read from the folder.
A folder without a tokenizer, and a tokenizer with neither pad nor EOS, are refused earlier, when the policy loads
(`policy.load_pretrained`).
"""

from __future__ import annotations

from typing import NamedTuple

from interleave_data.corpus import first_line
from interleave_data.prompts import format_prompt
from interleave_model.evaluation.alignment import align
from interleave_model.generation.rollout import decode
from interleave_model.model.policy import PolicyError
from interleave_model.preflight import token_counts
from interleave_model.preflight.token_counts import Longest
from interleave_model.runtime.machine import warn


class StageFit(NamedTuple):
    """What one length's longest example, in tokens, needs from the model's context."""

    n_words: int
    prompt_tokens: int  # the longest prompt, as collated (chat template included)
    answer_tokens: int  # the larger of the training budget for the longest target and the held-out `answer_budget`
    limit: int | None  # the tighter of the model's positions and vLLM's max_model_len; None when neither is set
    limit_name: str = "the model's max_position_embeddings"  # which one `limit` is

    @property
    def needed(self) -> int:
        return self.prompt_tokens + self.answer_tokens


def preflight(module, datamodule, stage: str = "fit") -> list[StageFit]:
    """Raise `PolicyError` on the first problem; return each length's token needs.

    Args:
        module: An `InterleaveGRPO` (its tokenizer, policy config and budget rule).
        datamodule: An `InterleaveDataModule` after `setup()`, built with the module's tokenizer.
        stage: The command's stage ("fit", "validate", "test", "predict"): only the lengths it reads are checked, so
            `validate --data.eval_stages '[10]'` is not refused for a 500-word training stage it never reads.
    """
    check_chat_template(module.tokenizer, datamodule.template, module.base.name_or_path)
    served = lengths(datamodule, stage)
    fits = stage_fits(module, datamodule, stage)
    for fit in fits:
        check_fit(fit)
    check_round_trip(module.tokenizer, [e.target for n in served for e in _examples(datamodule, n)])
    for line in few_texts(datamodule, served):
        warn(line)  # one `warning:` line, not Python's two with a source path
    return fits


# a held-out score at a length resting on fewer texts than this measures those texts more than the length: a fit
# warns below FEW_TEXTS, `check` below CHECK_FEW_TEXTS validation texts (and refuses below 2: no spread to measure)
FEW_TEXTS, CHECK_FEW_TEXTS = 5, 10


def text_counts(datamodule, n_words: int) -> dict[str, int]:
    """The distinct texts each split's pairs of `n_words` words are drawn from."""
    counts = {}
    for split in ("train", "val", "test"):
        examples = datamodule.examples(n_words, split)
        counts[split] = len({e.text_a for e in examples} | {e.text_b for e in examples})
    return counts


def few_texts(datamodule, served: list[int], below: int = FEW_TEXTS, splits=("val", "test")) -> list[str]:
    """One line per length and split whose held-out pairs come from fewer than `below` texts (long lengths of a small
    corpus: the default one has 8 validation and 8 test texts, and 3 of each of 500 words or more)."""
    lines = []
    for n in served:
        counts = text_counts(datamodule, n)
        lines += [f"the {n}-word {split} pairs come from {counts[split]} texts: a score there measures those texts "
                  "more than the length; add longer texts with data.corpus (docs/DATA.md)"
                  for split in splits if datamodule.examples(n, split) and counts[split] < below]  # fmt: skip
    return lines


def text_lines(datamodule, served: list[int]) -> tuple[list[str], list[str]]:
    """`check`'s lines on texts (each length's count per split, a warning below `CHECK_FEW_TEXTS` validation texts, a
    FAIL below 2) and its problems (one per FAIL)."""
    lines, problems = [], []
    for n in served:
        counts = text_counts(datamodule, n)
        lines.append(f"{n} words: texts train {counts['train']}, val {counts['val']}, test {counts['test']}")
        if datamodule.examples(n, "val") and counts["val"] < 2:
            fix = "add longer texts with data.corpus (docs/DATA.md), or drop the length"
            problem = f"its validation pairs come from {counts['val']} text, fewer than 2: {fix}"
            lines.append(f"{n} words: FAIL {problem}")
            problems.append(f"{n} words: {problem}")
    return lines + [f"warning: {line}" for line in few_texts(datamodule, served, CHECK_FEW_TEXTS, ("val",))], problems


def lengths(datamodule, stage: str = "fit") -> list[int]:
    """The lengths the command reads that the DataModule has examples of (`InterleaveDataModule.lengths_served`)."""
    return [n for n in datamodule.lengths_served(stage) if _examples(datamodule, n)]


def check_chat_template(tokenizer, template: str, name: str) -> None:
    """A chat template must render one user message with the generation prompt (some refuse it, or need a system)."""
    try:
        format_prompt("a", "b", template, tokenizer)
    except Exception as err:  # a template may raise anything (jinja's TemplateError, raise_exception, a TypeError)
        raise PolicyError(f"{name}: the chat template fails on one user message: {first_line(err)}") from err


def stage_fit(module, n_words: int, longest: Longest) -> StageFit:
    """Tokens the longest example of `n_words` words needs, by the budget rules the module uses: a training batch's
    follows its longest target, a held-out batch's is its length's (`answer_budget`); the larger counts.

    Args:
        module: An `InterleaveGRPO` (its policy config and budget rule).
        n_words: The length.
        longest: Its longest prompt and target in tokens, as collated (`token_counts.longest`).
    """
    try:
        trained = module.sampler.budget_for(longest.target)
        held_out = module.sampler.eval_budget({"n_words": [n_words], "target_ids": [[0] * longest.target]})
    except ValueError as err:  # a fixed max_new_tokens too small for this stage
        raise PolicyError(f"the {n_words}-word stage: {err}") from err
    answer = max(trained, held_out)
    config = getattr(module.policy, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    sampler = module.sampler
    engine_limit = sampler.vllm.max_model_len if sampler.kind == "vllm" and sampler.vllm is not None else None
    if engine_limit is not None and (limit is None or engine_limit < limit):
        return StageFit(n_words, longest.prompt, answer, engine_limit, "model.vllm.max_model_len")
    return StageFit(n_words, longest.prompt, answer, limit)


def stage_fits(module, datamodule, stage: str = "fit") -> list[StageFit]:
    """Each length the command reads, its longest example's tokens against the model's limit (not checked)."""
    return [stage_fit(module, n, longest) for n, longest in _longest(datamodule, lengths(datamodule, stage)).items()]


def check_fit(fit: StageFit) -> None:
    if fit.limit is not None and fit.needed > fit.limit:
        raise PolicyError(
            f"the {fit.n_words}-word stage needs {fit.needed} tokens ({fit.prompt_tokens} prompt + {fit.answer_tokens} "
            f"answer budget), more than {fit.limit_name} of {fit.limit}: "
            + ("raise it, or drop the stage" if fit.limit_name.startswith("model.") else "drop the stage")
        )


def check_round_trip(tokenizer, targets: list[str]) -> None:
    """Each target word must decode back to itself, else no answer could ever score 1 (e.g. a lowercasing tokenizer).

    Words are checked one by one, through the same decoding the completions get (`rollout.decode`).
    """
    words = list(dict.fromkeys(word for target in targets for word in target.split()))
    if not words:
        return
    for word, ids in zip(words, tokenizer(words, add_special_tokens=False)["input_ids"], strict=True):
        back = decode(tokenizer, ids)
        if back != word:
            raise PolicyError(
                f"the tokenizer does not round-trip the target word {word!r} (it decodes as {back!r}), so the "
                "reward could never reach 1: use the model's own tokenizer, without a normalizer"
            )


def report(module, datamodule) -> tuple[list[str], list[str]]:
    """What `python cli.py check` prints (what was read from the model folder, each check, one greedy answer), and
    each problem found, one line each (a FAIL among the lines)."""
    tok = module.tokenizer
    name = module.base.name_or_path
    stops = ", ".join(f"{i} {tok.convert_ids_to_tokens(i)!r}" for i in module.stop_ids)
    fallback = " (the EOS: the tokenizer sets no pad)" if tok.pad_token_id == tok.eos_token_id else ""
    lines = [
        f"model: {name}",
        f"stop ids: {stops}",
        f"pad: {tok.pad_token_id} {tok.pad_token!r}{fallback}",
        f"chat template: {'yes, one user message + generation prompt' if tok.chat_template else 'none, plain text'}",
    ]
    try:
        check_chat_template(tok, datamodule.template, name)
    except PolicyError as err:
        return lines + [f"FAIL {err}"], [str(err)]
    served = lengths(datamodule)
    ids = datamodule.collate(_examples(datamodule, served[0])[:1], "eval")["prompt_ids"][0].tolist()
    if tok.bos_token_id is not None:
        lines.append(f"bos: {tok.bos_token_id} {tok.bos_token!r}, {ids.count(tok.bos_token_id)} in a prompt")
    lines.append(f"prompt starts: {tok.convert_ids_to_tokens(ids[:6])}")
    counts = _longest(datamodule, served)
    checks = [(f"{n} words", lambda n=n: _fit_line(stage_fit(module, n, counts[n]))) for n in counts]
    targets = [e.target for n in served for e in _examples(datamodule, n)]
    checks.append(("round trip of the target words", lambda: check_round_trip(tok, targets)))
    texts, problems = text_lines(datamodule, served)
    lines += texts
    for label, check in checks:
        try:
            lines.append(f"{label}: {check() or 'ok'}")
        except PolicyError as err:
            lines.append(f"{label}: FAIL {err}")
            problems.append(f"{label}: {err}")
    example = _examples(datamodule, served[0])[0]
    batch = datamodule.collate([example], "eval")
    batch |= {key: batch[key].to(module.device) for key in ("prompt_ids", "prompt_mask")}
    answer = module.greedy(batch)[0]
    score = align(answer, example.target).score
    return lines + [f"target: {example.target}", f"greedy answer: {answer}", f"score: {score:.3f}"], problems


def _fit_line(fit: StageFit) -> str:
    check_fit(fit)
    limit = "no limit in the config" if fit.limit is None else f"limit {fit.limit} ({fit.limit_name})"
    return f"ok, {fit.needed} tokens ({fit.prompt_tokens} prompt + {fit.answer_tokens} answer budget), {limit}"


def _longest(datamodule, served: list[int]) -> dict[int, Longest]:
    """Each served length's longest prompt and target in tokens: every example is counted, as collated, since the
    longest in characters is not always the longest in tokens."""
    return token_counts.longest(datamodule, {n: _examples(datamodule, n) for n in served})


def _examples(datamodule, n_words: int) -> list:
    return [e for split in ("train", "val", "test") for e in datamodule.examples(n_words, split)]

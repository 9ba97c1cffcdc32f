"""Bad model folders are one clear line before any training step; `cli.py check` reads a folder as training will."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest

from cli import main, run
from interleave_data.pairs import interleave
from interleave_model.model.policy import PolicyError
from interleave_model.module import InterleaveGRPO
from interleave_model.preflight.checks import preflight
from interleave_model.settings.policy import Base
from interleave_model.settings.sampling import Sampling, VllmSettings
from tests.conftest import TINY_CONFIG


def _copy(family_folders, name: str, tmp_path):
    folder = tmp_path / name
    shutil.copytree(family_folders[name], folder)
    return folder


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _no_tokenizer(folder):
    (folder / "tokenizer.json").unlink()


def _neither_pad_nor_eos(folder):  # GPT-2 style: no pad, and its one special token no longer named EOS
    names = ("eos_token", "bos_token", "unk_token")
    _edit_json(folder / "tokenizer_config.json", lambda c: [c.pop(name) for name in names])


def _raising_template(folder):  # some templates refuse a conversation without a system message
    (folder / "chat_template.jinja").write_text("{{ raise_exception('a system message is required') }}")


def _short_context(folder):
    _edit_json(folder / "config.json", lambda c: c.update(max_position_embeddings=64))


def _lowercasing(folder):  # a normalizer: every answer would come back lowercased
    _edit_json(folder / "tokenizer.json", lambda t: t.update(normalizer={"type": "Lowercase"}))


def _no_step(self, *args):
    raise AssertionError("a training step ran: the check came after the warm-start began")


BAD = {
    "no tokenizer": ("llama3", _no_tokenizer, r"no tokenizer in the model folder \(none of tokenizer.json"),
    "neither pad nor eos": ("gpt2", _neither_pad_nor_eos, r"the tokenizer has neither a pad nor an EOS token"),
    "raising template": ("llama3", _raising_template, r"chat template fails on one user message: a system message is"),
    "short context": ("qwen2", _short_context, r"the 4-word stage needs \d+ tokens \(\d+ prompt \+ \d+ answer budget"),
    "lowercasing": ("llama3", _lowercasing, r"does not round-trip the target word '[^']*[A-Z][^']*' \(it decodes as"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_model_folder_is_one_line_and_exit_2_before_any_training_step(case, family_folders, tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    family, spoil, message = BAD[case]
    folder = _copy(family_folders, family, tmp_path)
    spoil(folder)
    monkeypatch.setattr(InterleaveGRPO, "training_step", _no_step)
    args = ["fit", "--config", str(TINY_CONFIG), f"--model.base.name_or_path={folder}", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", f"--data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip

    assert run(args) == 2

    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and re.search(message, errors[0]), err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == errors[0]


@pytest.fixture
def llama3_module(family_folders):
    folder = str(family_folders["llama3"])
    return InterleaveGRPO(base=Base(name_or_path=folder), template="compact", sampling=Sampling(num_generations=2))


def test_preflight_measures_each_stage_with_the_modules_budget(llama3_module, make_datamodule):
    module = llama3_module
    dm = make_datamodule(module.tokenizer)
    fits = preflight(module, dm)
    assert [fit.n_words for fit in fits] == [4, 8] and all(fit.limit == 2048 for fit in fits)
    for fit in fits:
        examples = [e for split in ("train", "val", "test") for e in dm.examples(fit.n_words, split)]
        batch = dm.collate(examples, "eval")  # every example
        assert fit.prompt_tokens == batch["prompt_mask"].sum(-1).max()
        assert fit.answer_tokens == module.sampler.budget(batch["target_ids"])
    needed = fits[1].needed
    module.policy.config.max_position_embeddings = needed - 1
    with pytest.raises(PolicyError, match=f"^the 8-word stage needs {needed} tokens .* of {needed - 1}: drop"):
        preflight(module, dm)


def test_preflight_checks_vllms_model_length_where_it_is_the_tighter_limit(llama3_module, make_datamodule):
    module = llama3_module
    dm = make_datamodule(module.tokenizer)
    needed = preflight(module, dm)[1].needed
    sampler = module.sampler
    kind, settings = sampler.kind, sampler.vllm
    try:
        sampler.kind, sampler.vllm = "vllm", VllmSettings(max_model_len=needed - 1)
        with pytest.raises(
            PolicyError, match=f"needs {needed} tokens .* model.vllm.max_model_len of {needed - 1}: raise"
        ):
            preflight(module, dm)
        sampler.vllm = VllmSettings(max_model_len=4096)  # above the model's 2048: the model's positions bind
        assert {fit.limit for fit in preflight(module, dm)} == {2048}
    finally:
        sampler.kind, sampler.vllm = kind, settings


def test_preflight_checks_the_lengths_the_command_reads(llama3_module, make_datamodule):
    module = llama3_module
    dm = make_datamodule(module.tokenizer, eval_stages=(4,), predict_split="train")
    eight = preflight(module, dm)[1]
    module.policy.config.max_position_embeddings = eight.needed - 1  # room for 4 words, not for 8

    for stage in ("validate", "test"):  # they read 4 words only: an 8-word training stage does not refuse them
        assert [fit.n_words for fit in preflight(module, dm, stage)] == [4]
    for stage in ("fit", "predict"):  # fit trains on 8 words, predict reads the training split of every stage
        with pytest.raises(PolicyError, match="^the 8-word stage needs"):
            preflight(module, dm, stage)


def test_preflight_finds_the_longest_example_in_tokens_not_in_characters(llama3_module, make_datamodule, monkeypatch):
    monkeypatch.setattr("interleave_model.preflight.token_counts.CHUNK", 16)  # several batches of examples
    module = llama3_module
    dm = make_datamodule(module.tokenizer)
    pool = dm.examples(4, "train")
    assert len(pool) > 32  # more examples than the preflight used to tokenize
    # The shortest example in characters becomes the longest in tokens: each of these symbols is 4 bytes that the small
    # BPE never merged, so a 3-symbol word is 12 tokens, where an English word of the corpus is a few
    shortest = min(range(len(pool)), key=lambda i: len(pool[i].target))
    a, b = "🜂🜃🜄 🜁🜂🜃 🜄🜁🜂 🜃🜄🜁", "🝆🝇🝈 🝉🝆🝇 🝈🝉🝆 🝇🝈🝉"
    pool[shortest] = dataclasses.replace(pool[shortest], a=a, b=b, target=" ".join(interleave(a.split(), b.split())))
    assert min(pool, key=lambda e: len(e.target)) is pool[shortest]

    (fit, _) = preflight(module, dm)

    batch = dm.collate([pool[shortest]], "eval")
    assert fit.answer_tokens == module.sampler.budget(batch["target_ids"])
    assert fit.prompt_tokens == batch["prompt_mask"].sum()


def test_round_trip_names_the_first_word_a_normalizer_changes(llama3_module, make_datamodule):
    module = llama3_module
    dm = make_datamodule(module.tokenizer)
    preflight(module, dm)
    from tokenizers import normalizers

    module.tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    targets = [e.target for n in (4, 8) for split in ("train", "val", "test") for e in dm.examples(n, split)]
    first = next(word for target in targets for word in target.split() if word.lower() != word)
    with pytest.raises(PolicyError, match=f"round-trip the target word {re.escape(repr(first))} "):
        preflight(module, dm)


def test_check_prints_what_was_read_each_stage_and_a_scored_greedy_answer(family_folders, tmp_path, capsys):
    folder = family_folders["llama3"]
    main(["check", "--config", str(TINY_CONFIG), f"--model.base.name_or_path={folder}", "--trainer.logger=false",
          f"--data.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    out = capsys.readouterr().out
    assert "stop ids: 1025 '<|end_of_text|>', 1028 '<|eom_id|>', 1029 '<|eot_id|>'" in out
    assert "pad: 1029 '<|eot_id|>' (the EOS: the tokenizer sets no pad)" in out
    assert "bos: 1024 '<|begin_of_text|>', 1 in a prompt" in out
    assert re.search(r"^4 words: ok, \d+ tokens .* limit 2048 \(the model's max_position_embeddings\)$", out, re.M)
    assert re.search(r"^8 words: ok, ", out, re.M) and "round trip of the target words: ok" in out
    assert re.search(r"^greedy answer: .*\nscore: \d\.\d{3}$", out, re.M)


@pytest.mark.parametrize("case", ["raising template", "lowercasing"])
def test_check_of_a_bad_folder_prints_its_fail_and_exits_2_with_the_problem(case, family_folders, tmp_path, capsys):
    """A template that fails stops the report early, a round trip fails among the checks: each is an error line."""
    family, spoil, message = BAD[case]
    folder = _copy(family_folders, family, tmp_path)
    spoil(folder)
    code = run(["check", "--config", str(TINY_CONFIG), f"--model.base.name_or_path={folder}", "--trainer.logger=false",
                f"--data.cache_dir={tmp_path / 'cache'}"])  # fmt: skip

    captured = capsys.readouterr()
    assert code == 2 and re.search(f"FAIL .*{message}", captured.out)
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(message, errors[0]), captured.err


def test_held_out_pairs_from_few_texts_are_named_per_length_and_split(tmp_path):
    from interleave_data.datamodule import InterleaveDataModule
    from interleave_model.preflight.checks import few_texts

    dm = InterleaveDataModule(stages=[10, 500], train_pairs=4, val_pairs=32, test_pairs=32, cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup("fit")

    lines = few_texts(dm, [10, 500])  # the default corpus: 8 held-out texts per split at 10 words, 3 at 500

    assert [line.split(":")[0] for line in lines] == ["the 500-word val pairs come from 3 texts"] + [
        "the 500-word test pairs come from 3 texts"
    ]


def test_few_held_out_texts_warn_in_one_line_each_on_stderr(llama3_module, make_datamodule, capsys, monkeypatch):
    from interleave_model.preflight import checks

    lines = ["the 8-word val pairs come from 3 texts: add texts", "the 8-word test pairs come from 4 texts: add texts"]
    monkeypatch.setattr(checks, "few_texts", lambda datamodule, served: lines if served == [4, 8] else [])
    dm = make_datamodule(llama3_module.tokenizer)
    capsys.readouterr()

    preflight(llama3_module, dm)

    assert capsys.readouterr().err.splitlines() == [f"warning: {line}" for line in lines]

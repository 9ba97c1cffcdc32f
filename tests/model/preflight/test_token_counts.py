"""The preflight's token counts are collate's, example by example, whatever state the shared tokenizer was left in."""

from __future__ import annotations

import dataclasses

import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from interleave_data.cache import cache_root
from interleave_data.pairs import interleave
from interleave_model.model.policy import prepare_tokenizer
from interleave_model.preflight import token_counts
from interleave_model.preflight.token_counts import Longest, lengths, longest


def _family(family_folders, name: str):
    return prepare_tokenizer(AutoTokenizer.from_pretrained(family_folders[name]))


@pytest.fixture(params=["tiny", "llama3", "qwen2", "gpt2"])
def tokenizer(request, family_folders, make_module):
    """The tiny word-level tokenizer (no chat template) and each family's BPE (chat templates, BOS or none)."""
    return make_module().tokenizer if request.param == "tiny" else _family(family_folders, request.param)


@pytest.fixture
def llama3(family_folders):
    return _family(family_folders, "llama3")


def _collated(dm, examples) -> tuple[list[int], list[int]]:
    batch = dm.collate(examples, "eval")
    return batch["prompt_mask"].sum(-1).tolist(), [len(ids) for ids in batch["target_ids"]]


def _longest_collated(dm, examples) -> Longest:
    return Longest(*map(max, _collated(dm, examples)))


def test_every_example_is_counted_as_collate_tokenizes_it(tokenizer, make_datamodule, monkeypatch):
    monkeypatch.setattr(token_counts, "CHUNK", 7)  # several chunks, the last one short
    dm = make_datamodule(tokenizer)
    examples = [e for split in ("train", "val", "test") for e in dm.examples(8, split)]
    collated, prompts = _collated(dm, examples), dm.collate(examples, "eval")["prompts"]
    # an earlier call may leave truncation (and padding) set on the shared backend; the counts must not see it
    tokenizer(["a b c d e f"], truncation=True, max_length=2, padding="max_length")
    backend = token_counts._backend(tokenizer, token_counts.pipeline(tokenizer))

    counted = list(lengths(tokenizer, backend, prompts, not tokenizer.chat_template))
    targets = list(lengths(tokenizer, backend, [e.target for e in examples], False))

    assert (counted, targets) == collated
    assert longest(dm, {8: examples}) == {8: Longest(max(counted), max(targets))}


def test_a_tokenizer_without_a_rust_backend_is_counted_through_its_own_call(llama3, make_datamodule, monkeypatch):
    monkeypatch.setattr(token_counts, "pipeline", lambda tokenizer: None)  # as for a slow (pure Python) tokenizer
    dm = make_datamodule(llama3)
    examples = dm.examples(8, "train")
    assert longest(dm, {8: examples}) == {8: _longest_collated(dm, examples)}


def test_special_token_text_is_split_when_the_tokenizer_says_so(llama3, make_datamodule):
    llama3.split_special_tokens = True  # the chat template's <|begin_of_text|> and headers become plain text
    dm = make_datamodule(llama3)
    examples = dm.examples(8, "train")
    assert longest(dm, {8: examples}) == {8: _longest_collated(dm, examples)}


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """The number of texts tokenized so far (the cache's misses)."""
    texts, count = [], token_counts.lengths

    def spy(tokenizer, backend, chunk, special):
        texts.append(len(chunk))
        return count(tokenizer, backend, chunk, special)

    monkeypatch.setattr(token_counts, "lengths", spy)
    return texts


def test_a_second_count_of_the_same_texts_reads_the_cache_and_tokenizes_nothing(llama3, make_datamodule, counted):
    dm = make_datamodule(llama3)
    pools = {n: dm.examples(n, "train") for n in (4, 8)}
    first = longest(dm, pools)
    assert counted == [40, 40, 40, 40]  # each length's prompts and targets
    assert len(list((cache_root(dm.cache_dir) / "token_counts").glob("*.json"))) == 2  # one file a length
    counted.clear()

    assert longest(dm, pools) == first and counted == []
    other = make_datamodule(llama3, train_pairs=41)  # other texts: a new count, beside the first
    assert longest(other, {8: other.examples(8, "train")}) and counted == [41, 41]


def _longer_example(dm):  # the first example's fragments become symbols a BPE never merged: more tokens than any other
    pool = dm.examples(4, "train")
    a, b = "🜂🜃🜄 🜁🜂🜃 🜄🜁🜂 🜃🜄🜁", "🝆🝇🝈 🝉🝆🝇 🝈🝉🝆 🝇🝈🝉"
    pool[0] = dataclasses.replace(pool[0], a=a, b=b, target=" ".join(interleave(a.split(), b.split())))


def _lowercasing(dm):
    dm.tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()


def _no_chat_template(dm):  # plain prompts, with the BOS the post-processor adds
    dm.tokenizer.chat_template = None


def _splitting_special_tokens(dm):
    dm.tokenizer.split_special_tokens = True


def _other_template(dm):
    dm.template = "two_processes"


CHANGES = {
    "an example's text": _longer_example,
    "the tokenizer's pipeline": _lowercasing,
    "the chat template": _no_chat_template,
    "split_special_tokens": _splitting_special_tokens,
    "the prompt template": _other_template,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_to_what_the_counts_depend_on_is_counted_anew(change, llama3, make_datamodule, counted):
    dm = make_datamodule(llama3)
    longest(dm, {4: dm.examples(4, "train")})
    counted.clear()

    CHANGES[change](dm)
    pool = dm.examples(4, "train")

    assert longest(dm, {4: pool}) == {4: _longest_collated(dm, pool)}
    assert counted == [40, 40]  # counted anew, not read back


def test_moving_characters_from_one_text_to_the_next_changes_the_key(llama3):
    state = token_counts.pipeline(llama3)
    splits = [(["ab", "c"], ["d"]), (["a", "bc"], ["d"]), (["a", "b"], ["cd"]), (["ab"], ["cd"])]
    assert len({token_counts._key(llama3, state, False, prompts, targets) for prompts, targets in splits}) == 4

"""Shared builders for the data tests."""

import json

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


def numbered_texts(n_texts: int, n_words: int, tag: str = "t") -> list[str]:
    """Distinct texts (text i has ``n_words + i`` words) whose words name their text and position."""
    return [" ".join(f"{tag}{i}w{j}" for j in range(n_words + i)) for i in range(n_texts)]


def write_jsonl(path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    return str(path)


def build_tokenizer(words: set[str], chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` that prepends [BOS] and pads with [PAD]; nothing is downloaded."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2}
    for word in sorted(words):
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 2)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]"
    )
    tokenizer.chat_template = chat_template
    return tokenizer

"""Small random-weight model folders that follow real families' conventions, built offline.

Each folder is written with `save_pretrained` and loaded back through the project's real `model_name_or_path` path,
so whatever a user's Llama-3, Qwen2 or GPT-2 folder does to tokens, prompts, stop ids and padding, the tests meet too:

- llama3: byte-level BPE in which id 0 is `!`, special tokens after the vocabulary, BOS added by the
  post-processor, no pad, eos `<|eot_id|>`, stop ids `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>` (a list),
  the Llama-3 chat template (which writes BOS itself).
- qwen2: byte-level BPE, no BOS, pad `<|endoftext|>`, eos `<|im_end|>`, stop ids `<|im_end|>`, `<|endoftext|>`,
  ChatML with its default system message.
- gpt2: byte-level BPE, no pad, BOS == EOS == `<|endoftext|>`, one stop id (an int), no chat template.

The models are 2 layers, 128 wide, with a head size of 64 (what inference engines support); the Llama has grouped-query
attention and tied embeddings. `python -m tests.families OUT_DIR` writes all three (for benchmarks and manual checks).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

FAMILIES = ("llama3", "qwen2", "gpt2")
VOCAB_SIZE = 1024  # BPE merges over the embedded corpus; small keeps the fixtures quick, large enough for real merges
WIDTH, LAYERS, HEADS = 128, 2, 2  # head size 64

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>"]  # fmt: skip
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPT2_SPECIALS = ["<|endoftext|>"]

# The shape of Llama-3.2's own template: a system header with dates, then turns, each closed by <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Qwen2's ChatML, with its default system message.
QWEN2_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.lru_cache(maxsize=1)
def _training_text() -> tuple[str, ...]:
    """The embedded corpus plus both prompt templates, as the BPE's training text."""
    from interleave_data.corpus import load_corpus
    from interleave_data.prompts import TEMPLATES

    return tuple(" ".join(t.words) for t in load_corpus().texts) + tuple(TEMPLATES.values())


def _byte_level_bpe(specials: list[str], bos: str | None = None):
    """A byte-level BPE trained on the embedded corpus; specials are added after it, so they get the last ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer.add_special_tokens(specials)
    if bos is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def build_llama3(folder: Path) -> Path:
    """Llama-3 conventions: BOS from the post-processor, no pad, eos `<|eot_id|>`, three stop ids, GQA, tied."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = _byte_level_bpe(LLAMA3_SPECIALS, bos="<|begin_of_text|>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        chat_template=LLAMA3_CHAT_TEMPLATE,
    )  # fmt: skip
    ids = {name: backend.token_to_id(name) for name in LLAMA3_SPECIALS}
    stops = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    config = LlamaConfig(
        vocab_size=backend.get_vocab_size(), hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1, head_dim=WIDTH // HEADS,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=stops, rope_theta=500000.0,
    )  # fmt: skip
    generation = GenerationConfig(bos_token_id=ids["<|begin_of_text|>"], eos_token_id=stops, do_sample=True,
                                  temperature=0.6, top_p=0.9)  # fmt: skip
    return _save(LlamaForCausalLM, config, tokenizer, generation, folder)


def build_qwen2(folder: Path) -> Path:
    """Qwen2 conventions: ChatML, no BOS, pad `<|endoftext|>`, eos `<|im_end|>`, two stop ids."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    backend = _byte_level_bpe(QWEN2_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=QWEN2_CHAT_TEMPLATE,
    )  # fmt: skip
    ids = {name: backend.token_to_id(name) for name in QWEN2_SPECIALS}
    stops = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    config = Qwen2Config(
        vocab_size=backend.get_vocab_size(), hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None, eos_token_id=stops[0],
        pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    generation = GenerationConfig(eos_token_id=stops, pad_token_id=ids["<|endoftext|>"], do_sample=True)
    return _save(Qwen2ForCausalLM, config, tokenizer, generation, folder)


def build_gpt2(folder: Path) -> Path:
    """GPT-2 conventions: no chat template, no pad, BOS == EOS == `<|endoftext|>`, one stop id (an int)."""
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    backend = _byte_level_bpe(GPT2_SPECIALS)
    end = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=end, eos_token=end, unk_token=end)
    end_id = backend.token_to_id(end)
    config = GPT2Config(
        vocab_size=backend.get_vocab_size(), n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=2048,
        bos_token_id=end_id, eos_token_id=end_id,
    )  # fmt: skip
    generation = GenerationConfig(bos_token_id=end_id, eos_token_id=end_id)
    return _save(GPT2LMHeadModel, config, tokenizer, generation, folder)


BUILDERS = {"llama3": build_llama3, "qwen2": build_qwen2, "gpt2": build_gpt2}


def build_family(name: str, folder: Path, seed: int = 0) -> Path:
    """Write the `name` family's folder (model, tokenizer, generation config) into `folder` and return it."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BUILDERS[name](Path(folder))


def _save(model_class, config, tokenizer, generation, folder: Path) -> Path:
    import torch

    model = model_class(config)
    # random weights give a near-uniform next token; larger logits make greedy answers and sampling less flat
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=0.5)
    model.generation_config = generation
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "families")
    for family in FAMILIES:
        print(build_family(family, out / family))

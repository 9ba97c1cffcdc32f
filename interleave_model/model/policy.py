"""Load the policy (any HF causal LM, or the embedded tiny model), its tokenizer, LoRA, and the frozen reference."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)
from transformers.pytorch_utils import Conv1D

from interleave_data.corpus import first_line, load_corpus
from interleave_data.prompts import format_prompt
from interleave_model.model.positions import COUPLED, COUPLING_MARKERS
from interleave_model.settings.policy import ALL_LINEAR, TINY, LoraSettings, TinyModelConfig

SPECIAL_TOKENS = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}


class PolicyError(ValueError):
    """A model or tokenizer that cannot be used, explained in one line."""


def build_policy(
    model_name_or_path: str,
    tiny: TinyModelConfig,
    corpus: list[str] | None,
    template: str,
    seed: int,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    lora: LoraSettings | None = None,
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast, list[int]]:
    """The policy (LoRA-wrapped when `lora` is set), its tokenizer and the ids that end a completion.

    Args are `model.base`'s (`settings.policy.Base`) and `InterleaveGRPO`'s of the same names: "tiny" builds the
    embedded tiny Llama, whose vocabulary is every word of `corpus` and `template`, seeded by `seed`; anything else
    is loaded with `from_pretrained`.
    """
    if model_name_or_path != TINY:
        policy, tokenizer = load_pretrained(model_name_or_path, dtype, attn_implementation, trust_remote_code)
    else:
        if tiny.positions == "coupled" and template != "compact":
            raise PolicyError(f"model.tiny.positions: coupled numbers the compact template's words; data.template is "
                              f"{template!r}: set it to compact")  # fmt: skip
        texts = [t.words for t in load_corpus(corpus).texts]
        tokenizer = build_tiny_tokenizer(texts, extra_words=format_prompt("", "", template).split())
        policy = build_tiny_model(tokenizer, tiny, seed=seed)
    stop_ids = stop_token_ids(policy, tokenizer)
    if lora is not None:
        policy = apply_lora(policy, lora)
    return policy, tokenizer, stop_ids


def prepare_for_training(policy: torch.nn.Module, disable_dropout: bool, gradient_checkpointing: bool) -> None:
    """Zero every dropout (`zero_dropout`) and turn on gradient checkpointing, as the settings ask."""
    if disable_dropout:
        zero_dropout(policy)
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.enable_input_require_grads()


def base_from_disk(policy: torch.nn.Module, model_name_or_path: str) -> bool:
    """LoRA on a model that `from_pretrained` loads again: its frozen base need not be in checkpoints."""
    return is_peft(policy) and model_name_or_path != TINY


def build_tiny_tokenizer(texts: Sequence[Sequence[str]], extra_words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary is every word of `texts` (all splits) plus `extra_words`.

    Every split's words are in the vocabulary so that held-out words get an id; the tiny model copies them through
    its frozen random embeddings without ever having been trained on them. Ids are assigned in sorted order, so the
    same corpus always gives the same tokenizer.
    """
    words = sorted({w for text in texts for w in text} | set(extra_words))
    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials + [w for w in words if w not in specials])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **SPECIAL_TOKENS)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig, seed: int = 0) -> PreTrainedModel:
    """A freshly initialised small Llama sized to `tokenizer`, seeded so every rank builds the same weights.

    `config.positions` "coupled" marks the Llama's config (`position_coupling`, saved in config.json) so that every
    forward of the project passes coupled positions; "none" builds a SmolLM3 (a Llama whose layers may skip rotary
    positions) with rotary off in every layer, which `from_pretrained`, vLLM and `generate` run as they are.
    """
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if config.positions == "none":
        nope = SmolLM3Config(**shape, no_rope_layers=[0] * config.num_layers, use_sliding_window=False)
        model_class, model_config = SmolLM3ForCausalLM, nope
    else:
        coupling = {}
        if config.positions == "coupled":
            markers = tokenizer.convert_tokens_to_ids(list(COUPLING_MARKERS))
            coupling = {"position_coupling": COUPLED, "coupling_markers": markers}
        model_class, model_config = LlamaForCausalLM, LlamaConfig(**shape, **coupling)
    with _seeded(seed):
        model = model_class(model_config)
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=config.embedding_std)
    if config.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


# Files from which `AutoTokenizer` builds a tokenizer; a folder with none of them has none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def load_pretrained(
    path: str, dtype: str | None = None, attn_implementation: str | None = None, trust_remote_code: bool = False
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Load a causal LM and its tokenizer from a local folder (or a hub name when online)."""
    looks_local = os.path.sep in path or path.startswith(".") or os.path.exists(path)
    if looks_local and not os.path.isdir(path):
        raise PolicyError(f"model path does not exist: {path}")
    has_tokenizer = any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)
    if looks_local and not trust_remote_code and not has_tokenizer:  # remote code may bring other tokenizer files
        raise PolicyError(f"{path}: no tokenizer in the model folder (none of {', '.join(TOKENIZER_FILES)})")
    kwargs = {"trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if dtype and dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise PolicyError(f"cannot load the tokenizer of {path!r}: {first_line(err)}") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        raise PolicyError(f"cannot load model {path!r}: {first_line(err)}") from err
    return model, prepare_tokenizer(tokenizer, path)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerFast, name: str = "tokenizer") -> PreTrainedTokenizerFast:
    """Pad on the left for generation; fall back to EOS as the pad token; refuse a tokenizer without EOS."""
    if tokenizer.eos_token_id is None:
        missing = "neither a pad nor an EOS token" if tokenizer.pad_token_id is None else "no EOS token"
        raise PolicyError(f"{name}: the tokenizer has {missing} (eos_token in tokenizer_config.json), so generation "
                          "could never stop")  # fmt: skip
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def stop_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids that end a completion: `generation_config.eos_token_id` (an int or a list) plus the tokenizer's EOS.

    Llama-3.2-Instruct's tokenizer names one EOS (`<|eot_id|>`, 128009) while its generation config lists 128001,
    128008 and 128009: the model may end a turn with any of them, and HF `generate` stops at each.
    """
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return sorted(set(configured) | {tokenizer.eos_token_id})


def apply_lora(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """Wrap `model` with a fresh LoRA adapter; only the adapter stays trainable."""
    from peft import LoraConfig, get_peft_model

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    layers = None
    if lora.top_layers is not None:
        total = model.config.num_hidden_layers
        if not 0 < lora.top_layers <= total:
            raise PolicyError(
                f"model.lora.top_layers: {lora.top_layers} is not between 1 and the model's {total} layers"
            )
        layers = list(range(total - lora.top_layers, total))
        if targets == ALL_LINEAR:  # peft takes a layer subset only with named modules
            head = model.get_output_embeddings()
            targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                              if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head})  # fmt: skip
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        layers_to_transform=layers,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def zero_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability in `model` to 0, adapters' included (TRL's `disable_dropout`).

    GRPO's ratio compares the policy with itself at sampling time: with dropout on, two forwards of the same weights
    differ, so the first ratio of a rollout is not 1 and the clip fires on noise. Llama-style attention reads a float
    `attention_dropout` in training mode instead of a dropout module; it is zeroed too.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A reference that never trains: a deep copy with gradients off, in eval mode."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


@contextlib.contextmanager
def as_reference(policy: torch.nn.Module, frozen: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The KL reference in eval mode: the policy with its adapter off under LoRA (no second copy), else `frozen`,
    the `frozen_copy` of the policy taken as GRPO started."""
    if is_peft(policy):
        with policy.disable_adapter(), eval_mode(policy):
            yield policy
        return
    if frozen is None:
        raise ValueError("a policy without LoRA needs its frozen copy as the reference")
    with eval_mode(frozen):
        yield frozen


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run a block with `model` in eval mode, then put back the mode it had."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def is_peft(model: torch.nn.Module) -> bool:
    """True when `model` carries a peft adapter (its reference is then the adapter switched off)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run a block under a fixed torch seed without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield

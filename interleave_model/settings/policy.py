"""The model trained and how it is loaded (`model.base`), the embedded tiny model's shape (`model.tiny`) and the
LoRA adapter (`model.lora`); read by `model/policy.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from interleave_model.settings import SettingsError

# The string choices, as types: a config naming another value is refused when it is parsed, before any step runs.
TinyPositions = Literal["rope", "coupled", "none"]

TINY = "tiny"
"""`model.base.name_or_path` of the embedded tiny Llama, built in memory (`model/policy.py`)."""


@dataclass
class Base:
    """The model trained, and how it is loaded and prepared (`model.base`).

    Args:
        name_or_path: A local HF model folder, a shipped model's name ("smollm2-135m-instruct": fetched and built
            into a cached folder on first use, `model/shipped.py`), a hub name (when online), or "tiny" for the
            embedded tiny Llama (`model.tiny`). None: the config names no model and the command asks for one.
        dtype: Weights dtype when loading ("bfloat16", "float32", "auto"); mixed precision is the trainer's.
        attn_implementation: Passed to `from_pretrained` ("sdpa", "eager", "flash_attention_2").
        trust_remote_code: Allow model code from the model folder. Off unless you trust it.
        gradient_checkpointing: Recompute activations in the backward pass (less memory, ~30% more time).
        disable_dropout: Set every dropout of the policy (adapter included) to 0, as TRL does by default: the ratio
            then compares equal forwards, and is exactly 1 at a rollout's first update.
        init_from: Start from the weights of an earlier run: its `.ckpt`, or a stage folder it exported
            (`<run>/stages/<N>words`, a full model or a LoRA adapter). Optimizer and curriculum start afresh.
    """

    name_or_path: str | None = TINY
    dtype: str | None = None
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    disable_dropout: bool = True
    init_from: str | None = None


@dataclass
class TinyModelConfig:
    """Shape of the embedded tiny Llama that the demo and the tests train on a CPU (`model.tiny`).

    Args:
        hidden_size: Width of the residual stream.
        num_layers: Number of decoder layers.
        num_heads: Attention heads (and key/value heads).
        intermediate_size: Width of the MLP.
        max_position_embeddings: Longest prompt + answer, in tokens (500-word stages need about 2,100).
        freeze_embeddings: Keep the tied embeddings at their random init. Measured: trainable embeddings never
            learn to copy words unseen in training (held-out plateau 0.83); frozen random ones do (0.97).
        embedding_std: Standard deviation of the (tied) embeddings' random init. As output rows they set how sharp
            the softmax can get: at 0.02 (the Llama default) supervised training plateaued near 0.92 held-out at
            10 words; at 0.1 the same run reached 0.98.
        positions: How the model numbers its tokens. "rope": rotary positions 0, 1, 2, ... (a stock Llama);
            "coupled": rotary positions coupled to the source words (`model.positions`: each answer word at its
            source word's position), which only the own sampler runs; "none": no positional encoding (NoPE, a
            SmolLM3 with rotary off in every layer).
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    freeze_embeddings: bool = True
    embedding_std: float = 0.1
    positions: TinyPositions = "rope"


ALL_LINEAR = "all-linear"
"""peft's shorthand for every linear layer but the output head, whatever the family calls them (Llama's seven
projections, GPT-2's `c_attn`, `c_proj`, `c_fc`)."""


@dataclass
class LoraSettings:
    """LoRA adapter settings (`model.lora`; null trains all weights), passed to `peft.LoraConfig`.

    Args:
        r: Rank of the update.
        alpha: Scaling numerator (`lora_alpha`); the update is scaled by alpha / r.
        dropout: Dropout on the adapter input.
        target_modules: Names of the linear layers that get an adapter, or "all-linear" (the default): every linear
            layer but the output head, under the family's own names.
        top_layers: Adapt only the last this many decoder layers (peft's `layers_to_transform`); None adapts all.
            The backward then stops at the lowest adapted layer: with the top third of the layers, an update costs
            about half of what the whole stack does.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str = ALL_LINEAR
    top_layers: int | None = None

    def __post_init__(self) -> None:
        if self.r < 1:
            raise SettingsError(f"model.lora.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise SettingsError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.top_layers is not None and self.top_layers < 1:
            raise SettingsError(f"model.lora.top_layers must be null or >= 1, got {self.top_layers}")

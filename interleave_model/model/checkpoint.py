"""Checkpoint files: atomic writes, what a resumed run needs beyond the weights, and the weights of an earlier run for
`init_from`.

A checkpoint is written next to its final name and renamed into place, so a run killed at any moment (SIGKILL
included) leaves either the previous complete file or the new complete file, never a torn one. Checkpoints of earlier
layouts are brought to today's on load (`model/migrations.py`).
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from interleave_data.atomic import replacing
from interleave_model.model.migrations import CHECKPOINT_VERSION, VERSION, migrated_hparams, old_paths
from interleave_model.model.policy import PolicyError, base_from_disk, frozen_copy, is_peft
from interleave_model.settings.groups import GROUPS, OPTIONAL, TERMS

# Checkpoint key, set when the frozen base weights were left out: a LoRA run whose base loads from disk keeps only
# what training changes (the adapter), not a copy of the base (6 GiB in bf16 for Llama-3.2-3B) at every save.
BASE_OMITTED = "base_weights_omitted"

# Checkpoints keep these settings in their hyperparameters as given, so perhaps as objects (`settings.groups.OPTIONAL`:
# `TinyModelConfig`, `LoraSettings`, `DynamicSampling`, `VllmSettings`); torch.load(weights_only=True) must accept
# them, under their paths and under the ones they had before they moved (`migrations.old_paths`): the unpickler maps
# each old name to today's class, importing nothing. Lightning's own loads (a resume, `load_from_checkpoint`) read
# them so too.
PICKLED_SETTINGS = tuple(OPTIONAL.values())
torch.serialization.add_safe_globals([*PICKLED_SETTINGS, *old_paths(PICKLED_SETTINGS)])


def safe_load(path: str | os.PathLike, what: str, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint read without running code: `torch.load(weights_only=True)`, which unpickles tensors, plain
    containers and the settings classes registered above (`PICKLED_SETTINGS`), and nothing else. A file holding
    any other object (a pickled command among them) is refused in one line naming `what`, never executed.

    Raises:
        PolicyError: The file holds objects a checkpoint of this project never holds.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        detail = f" ({found.group(1)})" if found else ""
        raise PolicyError(
            f"{what}: {path} holds objects other than tensors and this project's settings{detail}; it was not "
            "loaded, since unpickling them could run code. Load only checkpoints this project wrote"
        ) from None


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that writes `.<name>.tmp` in the target folder, fsyncs it, then renames it over the target.

    Use it in a config as `trainer.plugins: [{class_path: interleave_model.model.checkpoint.AtomicCheckpointIO}]`.
    Remote paths (`s3://`, ...) keep Lightning's own write.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, Path(path))


def save_run_state(
    checkpoint: dict[str, Any],
    policy: torch.nn.Module,
    model_name_or_path: str,
    sampling_rng: torch.Generator,
    device: torch.device,
    skipped_steps: int,
) -> None:
    """Add what a resumed run needs beyond the weights to `checkpoint` (`InterleaveGRPO.on_save_checkpoint`).

    The sampler's RNG, the global RNG (it draws LoRA's dropout masks; with it a resumed run continues them exactly)
    and the device's, and the count of skipped steps. LoRA on a base from disk (`policy.base_from_disk`) leaves the
    frozen base weights out and says so under `BASE_OMITTED`. The layout's version is stamped (`migrations.migrate`).
    """
    checkpoint[CHECKPOINT_VERSION] = VERSION
    checkpoint["sampling_rng"] = sampling_rng.get_state()
    checkpoint["torch_rng"] = torch.get_rng_state()
    if device.type == "cuda":
        checkpoint["cuda_rng"] = torch.cuda.get_rng_state(device)
    checkpoint["skipped_steps"] = skipped_steps
    if base_from_disk(policy, model_name_or_path):
        omitted = frozen_weight_keys(policy, prefix="policy.")
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in omitted}
        checkpoint[BASE_OMITTED] = model_name_or_path


def restore_run_state(
    checkpoint: dict[str, Any],
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    sampling_rng: Callable[[], torch.Generator],
    device: torch.device,
) -> tuple[int, torch.nn.Module | None]:
    """Put back what `save_run_state` added, before Lightning loads the weights (`InterleaveGRPO.on_load_checkpoint`).

    Args:
        checkpoint: The checkpoint being loaded.
        policy: The module's policy; a checkpoint without its base weights must hold all of its trainable ones.
        reference: The module's frozen reference, or None.
        sampling_rng: Gives the sampler's generator (called only when the checkpoint holds its state).
        device: The module's device.

    Returns:
        The count of skipped steps, and the reference: a fresh frozen copy of the policy when the checkpoint holds
        reference weights (loaded into it right after) and the module had none yet.
    """
    if BASE_OMITTED in checkpoint:
        source = f"the checkpoint's LoRA weights (base {checkpoint[BASE_OMITTED]})"
        check_weight_keys(policy, set(checkpoint["state_dict"]), source, prefix="policy.")
    if "sampling_rng" in checkpoint:
        sampling_rng().set_state(checkpoint["sampling_rng"])
    if "torch_rng" in checkpoint:
        torch.set_rng_state(checkpoint["torch_rng"])
    if "cuda_rng" in checkpoint and device.type == "cuda":
        torch.cuda.set_rng_state(checkpoint["cuda_rng"], device)
    if reference is None and any(k.startswith("reference.") for k in checkpoint["state_dict"]):
        reference = frozen_copy(policy)
    return checkpoint.get("skipped_steps", 0), reference


def resumed_temperature(checkpoint: dict[str, Any], configured: float) -> float:
    """The rollout temperature a run resumes at: the one it was sampling at (a curriculum may have raised it), unless
    this command configures another `model.sampling.temperature` than the checkpoint's run did: then the user's.

    Args:
        checkpoint: The checkpoint, migrated (`migrations.migrate`): the module's entry holds what it sampled at.
        configured: This command's `model.sampling.temperature`.
    """
    stored = checkpoint.get("temperature")
    sampling = (checkpoint.get("hyper_parameters") or {}).get("sampling")
    ran_with = sampling.get("temperature") if isinstance(sampling, dict) else getattr(sampling, "temperature", None)
    return configured if stored is None or ran_with != configured else stored


def checkpoint_groups(path: str | os.PathLike) -> dict[str, Any]:
    """The settings groups of a checkpoint's hyperparameters, in today's layout (`migrations.migrated_hparams`)."""
    hparams = safe_load(path, "load_from_checkpoint", mmap=True)["hyper_parameters"]
    return {name: value for name, value in migrated_hparams(hparams).items() if name in GROUPS | TERMS}


def atomic_torch_save(obj: Any, path: Path) -> None:
    """`torch.save(obj, path)` through a temporary file in the same folder and an atomic rename."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(path.parent)


def frozen_weight_keys(model: torch.nn.Module, prefix: str = "") -> set[str]:
    """`state_dict` keys of `model` that training never changes: every key but those of parameters with a gradient.

    Computed from the state dict, not from `named_parameters`, so tied weights (Llama-3.2's `lm_head.weight`) count.
    """
    return {prefix + key for key in model.state_dict()} - _trainable_keys(model, prefix)


def check_weight_keys(model: torch.nn.Module, loaded: set[str], source: str, prefix: str = "") -> None:
    """Refuse weights that name a key `model` lacks or leave out one of its trainable weights.

    Its frozen weights (`frozen_weight_keys`) may be left out: a LoRA checkpoint holds only the adapter.

    Raises:
        PolicyError: Naming the source and up to three offending keys.
    """
    expected = {prefix + key for key in model.state_dict()}
    unexpected, missing = sorted(loaded - expected), sorted(_trainable_keys(model, prefix) - loaded)
    if unexpected or missing:
        what = f"unexpected {unexpected[:3]}" if unexpected else f"missing {missing[:3]}"
        raise PolicyError(f"{source}: weights do not fit this model: {what}")


def _trainable_keys(model: torch.nn.Module, prefix: str) -> set[str]:
    return {prefix + name for name, p in model.named_parameters() if p.requires_grad}


def load_initial_weights(policy: torch.nn.Module, path: str | Path) -> None:
    """Load the weights of an earlier run into `policy` in place (the `--model.base.init_from` of a new run).

    Args:
        policy: The freshly built policy, LoRA-wrapped or not.
        path: A Lightning `.ckpt` of this module (its `policy.*` weights), a stage folder holding a full model
            (`config.json`), or a stage folder holding a LoRA adapter (`adapter_config.json`, needs `model.lora`).

    Raises:
        PolicyError: When the path is missing or its weights do not fit the policy.
    """
    path = Path(path)
    if not path.exists():
        raise PolicyError(f"model.base.init_from: {path} does not exist")
    if path.is_file():
        checkpoint = safe_load(path, "model.base.init_from")
        load_checkpoint_weights(policy, checkpoint, f"model.base.init_from: {path}", prefix="policy.")
    elif (path / "adapter_config.json").exists():
        if not is_peft(policy):
            raise PolicyError(
                f"model.base.init_from: {path} holds a LoRA adapter; set model.lora to continue training it"
            )
        from peft import load_peft_weights, set_peft_model_state_dict

        result = set_peft_model_state_dict(policy, load_peft_weights(str(path)))
        if result.unexpected_keys:
            raise PolicyError(
                f"model.base.init_from: {path} does not fit the adapter: {result.unexpected_keys[:3]} ..."
            )
    elif (path / "config.json").exists():
        base = policy.get_base_model() if is_peft(policy) else policy
        loaded = type(base).from_pretrained(path, dtype=next(base.parameters()).dtype)
        _load(base, loaded.state_dict(), f"model.base.init_from: {path}")
    else:
        raise PolicyError(f"model.base.init_from: {path} is neither a .ckpt file nor a saved model or adapter folder")


def load_checkpoint_weights(model: torch.nn.Module, checkpoint: dict, source: str, prefix: str = "") -> None:
    """Load the weights under `prefix` of a Lightning checkpoint into `model` in place.

    Every key must fit. A checkpoint whose frozen base was left out (`BASE_OMITTED`: a LoRA run on a base from disk)
    must still hold every trainable weight (`check_weight_keys`); `model` keeps the base it loaded itself.

    Args:
        model: The module (`prefix=""`) or its policy (`prefix="policy."`).
        checkpoint: The loaded checkpoint.
        source: Names the checkpoint in errors.
        prefix: Only the keys under it are read, with it removed.

    Raises:
        PolicyError: When the weights do not fit `model`.
    """
    weights = {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if BASE_OMITTED not in checkpoint:
        _load(model, weights, source)
        return
    check_weight_keys(model, set(weights), source)
    model.load_state_dict(weights, strict=False)


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise PolicyError(f"{source}: weights do not fit this model: {err}") from err


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

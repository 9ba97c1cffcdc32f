"""The old names that checkpoints and configs written by earlier versions of the project still use, kept alive here.

Two kinds of old name:

- **Module paths.** Before the subpackages (docs/ARCHITECTURE.md) the modules stood flat in `interleave_model/`. A
  checkpoint built from Python pickled its settings classes under those paths (`interleave_model.policy.LoraSettings`),
  and a config may name a class by one (`class_path: interleave_model.callbacks.CurriculumCallback`). An import
  finder, installed when `interleave_model` is imported, makes `interleave_model.policy` the module
  `interleave_model.model.policy` itself, the same object, imported on first use, so the class a config names is the
  class the code uses. The settings classes a checkpoint pickles stood in the modules that read them before
  `settings.py` held every group (`interleave_model.model.policy.LoraSettings`, `SETTINGS_MOVED`); those modules
  still import them, and `old_paths` gives every old path to `torch.serialization`, so `torch.load(weights_only=True)`
  accepts each.
- **Moved config keys.** `model.model_name_or_path`, `model.dtype`, `model.init_from`, ... are `model.base.*` now
  (the `base` entries of `FLAT_NAMES`), and the auxiliary terms' settings left `model.loss` for their own groups
  (`model.loss.beta` is `model.kl.beta`, `model.loss.guidance` is `model.guidance.weight`, ...: `LOSS_MOVED`). A
  command line or config file that still names one is refused in one line that names the new key
  (`check_moved_keys`, run by `cli.py` before parsing).
- **Flat settings.** Before the settings groups (`settings.py`) a checkpoint's hyperparameters held them flat
  (`model_name_or_path`, `dtype`, `temperature`, `eval_num_samples`, ...), and until the auxiliary terms had their
  groups, `loss` held theirs. `grouped_hparams` moves each into today's group, then drops the settings and groups
  removed since (`REMOVED`, `REMOVED_GROUPS`) with one line each; `checkpoint_groups` reads a checkpoint's groups that
  way for `InterleaveGRPO.load_from_checkpoint`, and the CLI's `checkpoint_hparams` hook calls `grouped_hparams`.

`import interleave_model` runs this module and must stay light (no torch), so what needs the settings or torch
imports them when first used. New code and docs use the new names.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import fields
from types import ModuleType
from typing import Any

_PACKAGE = "interleave_model"

# the groups whose fields were flat once under their own names (`evaluation`'s had an `eval_` prefix, and the
# auxiliary terms' stood in `loss`: `LOSS_MOVED`)
_FLAT_GROUPS = ("base", "sampling", "loss", "optimization")

# old module name -> its subpackage. `evaluation` and `preflight` are subpackages of those names now; nothing of
# theirs was ever pickled into a checkpoint or named by a config.
MOVED = {
    old: f"{subpackage}.{old}"
    for subpackage, olds in {
        "model": ("policy", "checkpoint", "export", "shipped"),
        "generation": ("rollout_cache", "rollout", "vllm_engine", "sampler"),
        "algorithm": ("logprobs", "grpo", "records", "rewards", "dynamic_sampling", "ranks", "schedule", "step_guard"),
        "evaluation": ("alignment", "metric", "report"),
        "preflight": ("token_counts",),
        "run": ("runs", "callbacks", "samples", "writers", "console"),
        "runtime": ("compat", "machine", "threads"),
    }.items()
    for old in olds
}


# settings class -> the module that held it before settings.py held every group; checkpoints pickled it there
SETTINGS_MOVED = {
    "TinyModelConfig": "model.policy",
    "LoraSettings": "model.policy",
    "DynamicSampling": "algorithm.dynamic_sampling",
    "VllmSettings": "generation.vllm_engine",
}


def old_paths(classes: Iterable[type]) -> list[tuple[type, str]]:
    """Each class with the dotted paths it had before it moved, as `torch.serialization.add_safe_globals` takes them:
    its module's before settings.py held every group (`interleave_model.model.policy.LoraSettings`) and that
    module's before the subpackages (`interleave_model.policy.LoraSettings`); a class that never moved has none."""
    found = []
    for cls in classes:
        before = SETTINGS_MOVED.get(cls.__qualname__)
        where = before or cls.__module__.removeprefix(f"{_PACKAGE}.")
        homes = ([before] if before else []) + [old for old, new in MOVED.items() if new == where]
        found += [(cls, f"{_PACKAGE}.{home}.{cls.__qualname__}") for home in homes]
    return found


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `interleave_model.<old name>` and hands back the moved module itself (not a second copy of it)."""

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, name = fullname.partition(".")
        return importlib.util.spec_from_loader(fullname, self) if package == _PACKAGE and name in MOVED else None

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(f"{_PACKAGE}.{MOVED[spec.name.partition('.')[2]]}")

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran when it was imported under its new name."""


sys.meta_path.append(_OldNames())


@functools.cache
def _flat_names() -> dict[str, tuple[str, str]]:
    from interleave_model.groups import GROUPS

    return (
        {
            field.name: (group, field.name)
            for group in _FLAT_GROUPS
            for field in fields(GROUPS[group])
            if (group, field.name) != ("base", "name_or_path")
        }
        | {
            "model_name_or_path": ("base", "name_or_path"),
            "eval_num_samples": ("evaluation", "num_samples"),
            "eval_temperature": ("evaluation", "temperature"),
            "pass_k": ("evaluation", "pass_k"),
            "pass_threshold": ("evaluation", "pass_threshold"),
            "sample_lengths": ("evaluation", "sample_lengths"),
        }
        | {name: (cls.lower(), name) for cls, name in REMOVED if cls.lower() in _FLAT_GROUPS}
        | {name: ("loss", name) for name in LOSS_MOVED}
    )


def __getattr__(name: str) -> Any:
    """`FLAT_NAMES`, `flat name -> (group, field)`: the names of checkpoints written before the groups existed.

    Built from the groups on first use (every field of the groups that existed then has its flat name), without
    importing the settings when `interleave_model` is imported. Only old checkpoints are read by these names.
    """
    if name == "FLAT_NAMES":
        return _flat_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the auxiliary terms' settings that left `model.loss` for their own groups: old field -> (group, field); the
# switches `guidance` (a weight, 0: off) and `reference_in_group` (a bool) became the groups' presence (null: off).
# `guidance.loss`, `guidance.final`, `guidance.decay_steps` and the `reference_in_group` group have left the code
# since: moved here, then dropped (`REMOVED`, `REMOVED_GROUPS`)
LOSS_MOVED = {
    "beta": ("kl", "beta"),
    "kl_estimator": ("kl", "estimator"),
    "guidance": ("guidance", "weight"),
    "guidance_final": ("guidance", "final"),
    "guidance_decay_steps": ("guidance", "decay_steps"),
    "guidance_loss": ("guidance", "loss"),
    "reference_in_group": ("reference_in_group", None),
    "shaping_gamma": ("reference_in_group", "shaping_gamma"),
}


def _a_group(key: str, value: Any) -> bool:
    """Whether a hyperparameter named like an old flat switch is today's group of that name (a dict, or None)."""
    return key in {group for group, _ in LOSS_MOVED.values()} and (value is None or isinstance(value, dict))


def _terms_out_of_loss(hparams: dict[str, Any]) -> dict[str, Any]:
    """Grouped hyperparameters whose `loss` still holds the auxiliary terms' settings, with those in their groups:
    `kl`, and `guidance` and `reference_in_group` where they were on (else None)."""
    loss = hparams.get("loss")
    if not isinstance(loss, dict) or not set(loss) & set(LOSS_MOVED):
        return hparams
    moved = {name: value for name, value in loss.items() if name in LOSS_MOVED}
    out = dict(hparams) | {"loss": {name: value for name, value in loss.items() if name not in LOSS_MOVED}}
    groups: dict[str, dict[str, Any]] = {group: {} for group, _ in LOSS_MOVED.values()}
    for name, value in moved.items():
        group, field = LOSS_MOVED[name]
        if field is not None:
            groups[group][field] = value
    # the old switches: a guidance weight of 0 and reference_in_group false were the terms off; the KL is a group always
    on = {
        "kl": True,
        "guidance": (moved.get("guidance") or 0.0) > 0,
        "reference_in_group": moved.get("reference_in_group"),
    }
    for group, values in groups.items():
        out.setdefault(group, values if on[group] else None)
    return out


# settings that left their group, as older checkpoints name them: `(group class name, field) -> why`
REMOVED = {
    ("Optimization", "sft_steps"): "the data's data.sft_steps schedules the phases (InterleaveGRPO.phases)",
    ("Loss", "credit"): "per-word credit had no finding on any subject; GRPO's credit per answer is used",
    ("Loss", "advantage_sign"): "learning from one sign of the advantages (PSR, NSR) lost to GRPO; both are used",
    ("Guidance", "loss"): "CHORD-phi changed nothing measurable; a phi run resumes with the plain cross-entropy",
    ("Guidance", "final"): "mu's decay changed nothing measurable; a run resumes at its constant model.guidance.weight",
    ("Guidance", "decay_steps"): "mu's decay changed nothing measurable; a run resumes at its constant "
    "model.guidance.weight",
}

# whole groups that left the code, as older checkpoints hold them (a dict: on, None: off): `group -> why`
REMOVED_GROUPS = {
    "reference_in_group": "the known answer as one more group member (LUFFY) had no lift; GRPO's own groups are used",
}


# the removed settings this process has said it ignores: a command reads a checkpoint's settings several times
TOLD: set[str] = set()


def _without_removed(hparams: dict[str, Any]) -> dict[str, Any]:
    """Grouped hyperparameters without the settings and groups removed since (`REMOVED`, `REMOVED_GROUPS`), one line
    for each one dropped (once per process); a removed group that was off (None) goes silently."""
    out = dict(hparams)
    for (cls, name), why in REMOVED.items():
        group = out.get(cls.lower())
        if isinstance(group, dict) and name in group:
            out[cls.lower()] = {key: value for key, value in group.items() if key != name}
            _tell_ignored(f"model.{cls.lower()}.{name}", why)
    for group, why in REMOVED_GROUPS.items():
        if out.pop(group, None) is not None:
            _tell_ignored(f"model.{group}", why)
    return out


def _tell_ignored(setting: str, why: str) -> None:
    """Say in one line, once per process, that a checkpoint's `setting` is no longer one."""
    from lightning.pytorch.utilities import rank_zero_info

    if setting not in TOLD:
        TOLD.add(setting)
        rank_zero_info(f"checkpoint: {setting} is no longer a setting, ignored ({why})")


def grouped_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's hyperparameters with any flat, pre-group settings moved into their groups, and the settings and
    groups removed since dropped (`REMOVED`, `REMOVED_GROUPS`, one line each).

    Other hyperparameters already grouped come back unchanged; a flat value wins over a default of its group.
    """
    from interleave_model.groups import GROUPS, field_values

    flat_names = _flat_names()
    # `guidance` and `reference_in_group` named a group (a dict, or None: off) and were flat switches before
    flat = {key: hparams[key] for key in flat_names if key in hparams and not _a_group(key, hparams[key])}
    if not flat:
        return _without_removed(_terms_out_of_loss(hparams))
    out = {key: value for key, value in hparams.items() if key not in flat}
    for key, value in flat.items():
        group, name = flat_names[key]
        current = out.get(group)
        values = dict(current) if isinstance(current, dict) else field_values(GROUPS[group], current)
        out[group] = values | {name: value}
    return _without_removed(_terms_out_of_loss(out))


def stored_temperature(checkpoint: dict[str, Any]) -> float | None:
    """The rollout temperature a checkpoint was training at: the module's entry, or where older checkpoints kept it,
    in the curriculum's state (the DataModule's entry, or before that the curriculum callback's). None: not stored."""
    if "temperature" in checkpoint:
        return checkpoint["temperature"]
    curriculum = (checkpoint.get("InterleaveDataModule") or {}).get("curriculum") or {}
    callback = (checkpoint.get("callbacks") or {}).get("CurriculumCallback") or {}
    return curriculum.get("temperature", callback.get("temperature"))


def configured_temperature(checkpoint: dict[str, Any]) -> float | None:
    """The `model.sampling.temperature` a checkpoint's run was configured with (flat in older checkpoints)."""
    from interleave_model.groups import field_values

    sampling = grouped_hparams(checkpoint.get("hyper_parameters") or {}).get("sampling")
    if sampling is None:
        return None
    values = dict(sampling) if isinstance(sampling, dict) else field_values(type(sampling), sampling)
    return values.get("temperature")


def resumed_temperature(checkpoint: dict, configured: float) -> float:
    """The rollout temperature a run resumes at: the one it was sampling at (a curriculum may have raised it), unless
    this command configures another `model.sampling.temperature` than the checkpoint's run did: then the user's."""
    stored = stored_temperature(checkpoint)
    if stored is None or configured_temperature(checkpoint) != configured:
        return configured
    return stored


def checkpoint_groups(checkpoint_path) -> dict[str, dict[str, Any]]:
    """The settings groups of a checkpoint's hyperparameters, flat settings of an older one put into their groups."""
    from interleave_model.groups import GROUPS, TERMS
    from interleave_model.model.checkpoint import safe_load

    hparams = safe_load(checkpoint_path, "load_from_checkpoint", mmap=True)["hyper_parameters"]
    return {name: value for name, value in grouped_hparams(hparams).items() if name in GROUPS | TERMS}


class MovedKeyError(ValueError):
    """A config or command line names a key that moved; the message names the new one."""


def check_moved_keys(args: Iterable[str]) -> None:
    """Refuse a command line, or a `--config` file it names, that sets a key of `model` that moved: into `model.base`
    (the flat names of its fields, `FLAT_NAMES`), or out of `model.loss` into an auxiliary term's group
    (`LOSS_MOVED`). A key whose new home has left the code since (`REMOVED`, `REMOVED_GROUPS`) is left to the
    parser, which refuses it as any unknown key.

    Raises:
        MovedKeyError: Naming the flag or the file, the old key and the new one.
    """
    import yaml

    moved = {old: ".".join(new) for old, new in _flat_names().items() if new[0] == "base"}  # old key -> new key
    gone = {(cls.lower(), name) for cls, name in REMOVED}
    moved |= {
        f"loss.{old}": ".".join(name for name in new if name)
        for old, new in LOSS_MOVED.items()
        if new[0] not in REMOVED_GROUPS and new not in gone
    }
    args = list(args)
    for i, arg in enumerate(args):
        key = arg.removeprefix("--model.").partition("=")[0]
        if arg.startswith("--model.") and key in moved:
            raise MovedKeyError(f"--model.{key} is now --model.{moved[key]}")
        given = arg == "--config" and i + 1 < len(args)
        path = arg.partition("=")[2] if arg.startswith("--config=") else args[i + 1] if given else None
        if path is None:
            continue
        try:
            with open(path) as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue  # the CLI's parser reports a file it cannot read
        model = config.get("model") if isinstance(config, dict) else None
        model = model.get("init_args", model) if isinstance(model, dict) else None
        model = model if isinstance(model, dict) else {}
        loss = model.get("loss")
        for key in [*model, *(f"loss.{name}" for name in (loss if isinstance(loss, dict) else ()))]:
            if key in moved:
                raise MovedKeyError(f"{path}: model.{key} is now model.{moved[key]}")

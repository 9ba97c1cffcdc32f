"""Checkpoints of earlier layouts brought to today's: one function per breaking change, applied in order on load.

As Lightning migrates its own part (`lightning.pytorch.utilities.migration`), each change of what a checkpoint holds
is one function on the checkpoint dict, filed under the version that made it (`MIGRATIONS`); `migrate` runs those
newer than the checkpoint's `CHECKPOINT_VERSION` in order, in place, and stamps the dict with today's version
(`save_run_state` stamps every save). Checkpoints written before the stamp carry none (version 0) and may hold any
earlier layout, so each function leaves a dict already in its new layout as it is.

`InterleaveGRPO.on_load_checkpoint` migrates: Lightning hands it the loaded checkpoint before the DataModule's and
the callbacks' entries are restored, so each of them reads only today's layout. The hyperparameters are read earlier
(the CLI's `checkpoint_hparams`, `load_from_checkpoint`'s arguments): `migrated_hparams` gives them alone.

The settings classes a checkpoint pickles were named by other module paths once (`old_paths`); `model/checkpoint.py`
registers those names with torch, whose `weights_only` unpickler maps each to today's class without importing
anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from interleave_model.settings.groups import GROUPS, field_values

_PACKAGE = "interleave_model"

# the key a checkpoint's migration version is stamped under (absent: written before migrations were versioned)
CHECKPOINT_VERSION = "interleave_checkpoint_version"

Migration = Callable[[dict[str, Any]], None]

# ---------------------------------------------------------------- old module paths of the pickled settings classes

# old module name -> its subpackage, from when the modules stood flat in `interleave_model/`
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

# settings class -> the modules that held it before `settings/policy.py` or `settings/sampling.py`, latest first:
# `settings.py`, which held every group once, and before it the module that read it; checkpoints pickled it there
SETTINGS_MOVED = {
    "TinyModelConfig": ("settings", "model.policy"),
    "LoraSettings": ("settings", "model.policy"),
    "DynamicSampling": ("settings", "algorithm.dynamic_sampling"),
    "VllmSettings": ("settings", "generation.vllm_engine"),
}


def old_paths(classes: Iterable[type]) -> list[tuple[type, str]]:
    """Each class with the dotted paths it had before it moved, as `torch.serialization.add_safe_globals` takes them:
    its modules' before the settings package (`interleave_model.settings.LoraSettings`,
    `interleave_model.model.policy.LoraSettings`), and each of those modules' and its own before the subpackages
    (`interleave_model.policy.LoraSettings`); a class that never moved has none."""
    found = []
    for cls in classes:
        before = SETTINGS_MOVED.get(cls.__qualname__, ())
        where = (*before, cls.__module__.removeprefix(f"{_PACKAGE}."))
        homes = [*before, *(old for old, new in MOVED.items() if new in where)]
        found += [(cls, f"{_PACKAGE}.{home}.{cls.__qualname__}") for home in homes]
    return found


# ---------------------------------------------------------------- the tables of moved and removed settings

# the auxiliary terms' settings that left `model.loss` for their own groups: old field -> (group, field); the
# switches `guidance` (a weight, 0: off) and `reference_in_group` (a bool) became the groups' presence (null: off).
# `guidance.loss`, `guidance.final`, `guidance.decay_steps` and the `reference_in_group` group have left the code
# since: moved here, then dropped (`REMOVED`)
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

# settings that left the code, as older checkpoints name them: `(group, field) -> why`; field None: the whole group
# (a dict: on, None: off)
REMOVED = {
    ("optimization", "sft_steps"): "the data's data.sft_steps schedules the phases (InterleaveGRPO.phases)",
    ("loss", "credit"): "per-word credit had no finding on any subject; GRPO's credit per answer is used",
    ("loss", "advantage_sign"): "learning from one sign of the advantages (PSR, NSR) lost to GRPO; both are used",
    ("guidance", "loss"): "CHORD-phi changed nothing measurable; a phi run resumes with the plain cross-entropy",
    ("guidance", "final"): "mu's decay changed nothing measurable; a run resumes at its constant model.guidance.weight",
    ("guidance", "decay_steps"): "mu's decay changed nothing measurable; a run resumes at its constant "
    "model.guidance.weight",
    ("reference_in_group", None): "the known answer as one more group member (LUFFY) had no lift; GRPO's own groups "
    "are used",
}

# the groups whose fields were flat once under their own names (`evaluation`'s had an `eval_` prefix, and the
# auxiliary terms' stood in `loss`: `LOSS_MOVED`)
_FLAT_GROUPS = ("base", "sampling", "loss", "optimization")

# `flat name -> (group, field)`: the names of checkpoints written before the groups existed. Every field of today's
# flat groups has its flat name (the tests write old checkpoints from today's settings by it); only old checkpoints
# are read by these names.
FLAT_NAMES: dict[str, tuple[str, str]] = (
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
    | {name: (group, name) for group, name in REMOVED if group in _FLAT_GROUPS}
    | {name: ("loss", name) for name in LOSS_MOVED}
)

# ---------------------------------------------------------------- the migrations


def curriculum_one_owner(checkpoint: dict[str, Any]) -> None:
    """The curriculum's state in one entry, the DataModule's `curriculum` (git 35e5889 and earlier kept it in two).

    The DataModule's entry held the stream's part, `{"stage_index": <drawn stage>, "moves": [[from_batch, index],
    ...]}` (moves only when pending), and `checkpoint["callbacks"]["CurriculumCallback"]` the decisions' part, every
    field of the state of then; the old callback started from the DataModule's stage when it had no state of its own.
    Such a resume owes the whole held-out curve at its first check (`curve_passes` 0): the DataModule counted the
    stages passed before the callback's entry brought the history.
    """
    callback = (checkpoint.get("callbacks") or {}).pop("CurriculumCallback", None)
    datamodule = checkpoint.get("InterleaveDataModule")
    if datamodule is not None and "curriculum" in datamodule:
        return
    old = dict(datamodule or {})
    state = {}
    if "stage_index" in old:
        drawn = old.pop("stage_index")
        state = {"stage_index": drawn, "drawn_index": drawn, "moves": old.pop("moves", [])}
    if datamodule is not None or callback is not None:
        checkpoint["InterleaveDataModule"] = {"curve_passes": 0} | old | {"curriculum": state | (callback or {})}


def settings_grouped(checkpoint: dict[str, Any]) -> None:
    """The model's flat hyperparameters (`model_name_or_path`, `temperature`, `eval_num_samples`, ...) in their groups
    (`FLAT_NAMES`); a flat value wins over its group's. The auxiliary terms' stood in `loss` then
    (`terms_out_of_loss` moves them on)."""
    hparams = checkpoint.get("hyper_parameters") or {}
    # `guidance` and `reference_in_group` name a group (a dict, or None: off) and were flat switches before
    flat = {key: hparams[key] for key in FLAT_NAMES if key in hparams and not _a_group(key, hparams[key])}
    if not flat:
        return
    out = {key: value for key, value in hparams.items() if key not in flat}
    for key, value in flat.items():
        group, name = FLAT_NAMES[key]
        current = out.get(group)
        values = dict(current) if isinstance(current, dict) else field_values(GROUPS[group], current)
        out[group] = values | {name: value}
    checkpoint["hyper_parameters"] = out


def terms_out_of_loss(checkpoint: dict[str, Any]) -> None:
    """The auxiliary terms' settings out of `loss` into their groups (`LOSS_MOVED`): `kl` always, `guidance` and
    `reference_in_group` where their switches had them on (else None)."""
    hparams = checkpoint.get("hyper_parameters") or {}
    loss = hparams.get("loss")
    if not isinstance(loss, dict) or not set(loss) & set(LOSS_MOVED):
        return
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
    checkpoint["hyper_parameters"] = out


def temperature_on_the_module(checkpoint: dict[str, Any]) -> None:
    """The rollout temperature a run was sampling at as the module's entry (`checkpoint["temperature"]`); the
    curriculum's state held it before (None: never raised)."""
    curriculum = (checkpoint.get("InterleaveDataModule") or {}).get("curriculum")
    if not isinstance(curriculum, dict) or "temperature" not in curriculum:
        return
    stored = curriculum.pop("temperature")
    if stored is not None:
        checkpoint.setdefault("temperature", stored)


def dropped(group: str, name: str | None, why: str) -> Migration:
    """The migration of a setting that left the code: `group.name` (name None: the whole group) out of the
    hyperparameters, said in one line where it was set; a removed group that was off (None) goes silently."""

    def drop(checkpoint: dict[str, Any]) -> None:
        hparams = checkpoint.get("hyper_parameters") or {}
        values = hparams.get(group)
        if name is None and group in hparams:
            checkpoint["hyper_parameters"] = {key: value for key, value in hparams.items() if key != group}
            if values is not None:
                _tell_ignored(f"model.{group}", why)
        elif name is not None and isinstance(values, dict) and name in values:
            hparams = dict(hparams) | {group: {key: value for key, value in values.items() if key != name}}
            checkpoint["hyper_parameters"] = hparams
            _tell_ignored(f"model.{group}.{name}", why)

    drop.__name__ = f"drop_{group}" + (f"_{name}" if name else "")
    return drop


# version -> the migrations it brought, in the order they apply; a later change is a new version with its functions
MIGRATIONS: dict[int, list[Migration]] = {
    1: [
        curriculum_one_owner,
        settings_grouped,
        terms_out_of_loss,
        temperature_on_the_module,
        *(dropped(group, name, why) for (group, name), why in REMOVED.items()),
    ],
}

VERSION = max(MIGRATIONS)


def migrate(checkpoint: dict[str, Any]) -> dict[int, list[str]]:
    """Bring `checkpoint` to today's layout in place: each migration of a version newer than its stamp, in order;
    then stamp it with today's `VERSION`. Returns the names of the migrations run, by version."""
    stamped = checkpoint.get(CHECKPOINT_VERSION, 0)
    applied = {}
    for version, migrations in MIGRATIONS.items():
        if version <= stamped:
            continue
        for migration in migrations:
            migration(checkpoint)
        applied[version] = [migration.__name__ for migration in migrations]
    checkpoint[CHECKPOINT_VERSION] = max(stamped, VERSION)
    return applied


def migrated_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's hyperparameters in today's groups: `migrate` on them alone, as an unstamped checkpoint's (every
    migration runs, each leaving today's layout as it is); the dict given is left as is."""
    checkpoint = {"hyper_parameters": dict(hparams)}
    migrate(checkpoint)
    return checkpoint["hyper_parameters"]


def _a_group(key: str, value: Any) -> bool:
    """Whether a hyperparameter named like an old flat switch is today's group of that name (a dict, or None)."""
    return key in {group for group, _ in LOSS_MOVED.values()} and (value is None or isinstance(value, dict))


# the removed settings this process has said it ignores: a command reads a checkpoint's settings several times
TOLD: set[str] = set()


def _tell_ignored(setting: str, why: str) -> None:
    """Say in one line, once per process, that a checkpoint's `setting` is no longer one."""
    if setting not in TOLD:
        TOLD.add(setting)
        rank_zero_info(f"checkpoint: {setting} is no longer a setting, ignored ({why})")

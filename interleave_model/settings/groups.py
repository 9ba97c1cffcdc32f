"""The module's settings groups by key (`GROUPS`, always set; `TERMS`, the terms a run may leave out; `OPTIONAL`,
the other groups that may be null), what `InterleaveGRPO` is given made its groups (`module_groups`, the one place
the groups are checked across), and the groups as its hyperparameters keep them (`as_hparams`)."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from interleave_model.settings import SettingsError
from interleave_model.settings.evaluation import Evaluation
from interleave_model.settings.loss import Guidance, Kl, Loss
from interleave_model.settings.optimization import Optimization
from interleave_model.settings.policy import Base, LoraSettings, TinyModelConfig
from interleave_model.settings.sampling import DynamicSampling, Sampling, VllmSettings

# the groups that always hold a value: the module keeps them in its hparams as plain dicts
GROUPS: dict[str, type] = {
    "base": Base,
    "sampling": Sampling,
    "loss": Loss,
    "kl": Kl,
    "optimization": Optimization,
    "evaluation": Evaluation,
}


# the auxiliary terms a run may leave out (null: off); kept in the hparams as plain dicts, or None
TERMS: dict[str, type] = {
    "guidance": Guidance,
}

# the other groups that may be null; kept in the hparams as given, so a checkpoint may pickle them
# (`model/checkpoint.PICKLED_SETTINGS`)
OPTIONAL: dict[str, type] = {
    "tiny": TinyModelConfig,
    "lora": LoraSettings,
    "dynamic_sampling": DynamicSampling,
    "vllm": VllmSettings,
}


def module_groups(**given: Any) -> dict[str, Any]:
    """Every group `InterleaveGRPO` takes, by key, as its dataclass: from an instance, or a dict as a loaded
    checkpoint's hyperparameters hold it; a fresh instance for each of `GROUPS` (the defaults are shared), None where
    a group that may be null is. Then the checks across groups (`check_groups`)."""
    groups = {name: as_group(cls, given[name]) for name, cls in GROUPS.items()}
    groups |= {name: typed(cls, given[name]) for name, cls in (TERMS | OPTIONAL).items()}
    check_groups(groups)
    return groups


def check_groups(groups: dict[str, Any]) -> None:
    """Refuse settings that do not fit together across groups; each group has checked its own values when built."""
    sampling, loss = groups["sampling"], groups["loss"]
    if loss.loss_type == "dr_grpo" and (loss.max_completion_length or sampling.max_new_tokens) is None:
        raise SettingsError(
            "model.loss.loss_type: dr_grpo needs model.loss.max_completion_length "
            "(or a fixed model.sampling.max_new_tokens)"
        )


def as_hparams(groups: dict[str, Any]) -> dict[str, Any]:
    """`GROUPS` and `TERMS` as the module's hyperparameters keep them: plain dicts (None for a term off), as the CLI
    gives them and jsonargparse parses them back."""
    return {name: groups[name] and asdict(groups[name]) for name in GROUPS | TERMS}


def typed(cls: type, value: Any) -> Any:
    """Settings as `cls` (a dataclass): a dict, as a loaded checkpoint's hyperparameters hold them, becomes one."""
    return cls(**value) if isinstance(value, dict) else value


def as_group(cls: type, value: Any) -> Any:
    """A group's settings as a fresh instance of `cls`, from an instance, a dict (a loaded checkpoint) or None."""
    return cls(**(value if isinstance(value, dict) else field_values(cls, value)))


def field_values(cls: type, value: Any) -> dict[str, Any]:
    """The fields of a group's instance, by name; none for None."""
    if value is None:
        return {}
    return {field.name: getattr(value, field.name) for field in fields(cls)}

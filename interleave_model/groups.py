"""The module's settings groups by key (`GROUPS`, always set; `TERMS`, the terms a run may leave out), how an
instance or a checkpoint's dict becomes a group, and the checks across groups."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from interleave_model.loss_settings import Guidance, Kl, Loss, Optimization
from interleave_model.settings import Base, Evaluation, Sampling, SettingsError

# the groups that always hold a value: the module keeps them in its hparams as plain dicts (the others as given)
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


def check_groups(sampling: Sampling, loss: Loss) -> None:
    """Refuse settings that do not fit together across groups."""
    if loss.loss_type == "dr_grpo" and (loss.max_completion_length or sampling.max_new_tokens) is None:
        raise SettingsError(
            "model.loss.loss_type: dr_grpo needs model.loss.max_completion_length "
            "(or a fixed model.sampling.max_new_tokens)"
        )


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

"""Config keys and class paths that moved: a command line or `--config` file that still names one is refused in one line
that names the new one (`check_moved_keys`, run by `cli.py` before parsing).

- `model.model_name_or_path`, `model.dtype`, `model.init_from`, ... are `model.base.*` (the `base` entries of
  `migrations.FLAT_NAMES`), and the auxiliary terms' settings left `model.loss` for their own groups
  (`model.loss.beta` is `model.kl.beta`, `model.loss.guidance` is `model.guidance.weight`, ...:
  `migrations.LOSS_MOVED`).
- Classes of the modules that stood flat in `interleave_model/` live in subpackages
  (`interleave_model.callbacks.CurriculumCallback` is `interleave_model.run.callbacks.CurriculumCallback`:
  `migrations.MOVED`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import yaml

from interleave_model.model.migrations import FLAT_NAMES, LOSS_MOVED, MOVED, REMOVED

# top-level keys LightningCLI offers and this CLI does not (the optimizer is the module's own)
NOT_OFFERED = ("optimizer", "lr_scheduler")
# `interleave_model.<old module>.<name>`: a class path from before the subpackages
_OLD_CLASS_PATH = re.compile(rf"\binterleave_model\.({'|'.join(MOVED)})\.(\w+)")


class MovedKeyError(ValueError):
    """A config or command line names a key or a class path that moved; the message names the new one."""


def _moved_keys() -> dict[str, str]:
    """Old key under `model` -> its new key. A key whose new home has left the code since (`REMOVED`) is left to the
    parser, which refuses it as any unknown key."""
    moved = {old: ".".join(new) for old, new in FLAT_NAMES.items() if new[0] == "base"}
    return moved | {
        f"loss.{old}": ".".join(name for name in new if name)
        for old, new in LOSS_MOVED.items()
        if (new[0], None) not in REMOVED and new not in REMOVED
    }


def check_moved_keys(args: Iterable[str]) -> None:
    """Refuse a command line, or a `--config` file it names, that sets a key of `model` that moved, names a class by
    its path from before the subpackages, or sets `optimizer` / `lr_scheduler` (a run's saved config from when the CLI
    offered them holds both, null).

    Raises:
        MovedKeyError: Naming the flag or the file, the old key or path and the new one.
    """
    moved = _moved_keys()
    args = list(args)
    for i, arg in enumerate(args):
        key = arg.removeprefix("--model.").partition("=")[0]
        if arg.startswith("--model.") and key in moved:
            raise MovedKeyError(f"--model.{key} is now --model.{moved[key]}")
        _check_class_paths([arg], "")
        given = arg == "--config" and i + 1 < len(args)
        path = arg.partition("=")[2] if arg.startswith("--config=") else args[i + 1] if given else None
        if path is None:
            continue
        try:
            with open(path) as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue  # the CLI's parser reports a file it cannot read
        _check_class_paths(_strings(config), f"{path}: ")
        offered = [key for key in NOT_OFFERED if isinstance(config, dict) and key in config]
        if offered:  # a run's saved config.yaml from when the CLI offered them wrote both as null
            keys = " and ".join(offered) + (" are" if len(offered) > 1 else " is")
            raise MovedKeyError(f"{path}: {keys} not settings here (AdamW with its schedule from model.optimization): "
                                "delete the lines")  # fmt: skip
        model = config.get("model") if isinstance(config, dict) else None
        model = model.get("init_args", model) if isinstance(model, dict) else None
        model = model if isinstance(model, dict) else {}
        loss = model.get("loss")
        for key in [*model, *(f"loss.{name}" for name in (loss if isinstance(loss, dict) else ()))]:
            if key in moved:
                raise MovedKeyError(f"{path}: model.{key} is now model.{moved[key]}")


def _check_class_paths(values: Iterable[str], where: str) -> None:
    for value in values:
        found = _OLD_CLASS_PATH.search(value)
        if found:
            old, name = found.groups()
            raise MovedKeyError(f"{where}interleave_model.{old}.{name} is now interleave_model.{MOVED[old]}.{name}")


def _strings(value: Any) -> Iterator[str]:
    """Every string in a parsed YAML document, keys and values."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)

"""Policy, GRPO loss, alignment metric and callbacks for word-interleaving training, in subpackages by job
(docs/ARCHITECTURE.md): model/, generation/, algorithm/, evaluation/, preflight/, run/, runtime/.

The modules that once stood flat here keep their old names as aliases: `interleave_model.policy` is the module
`interleave_model.model.policy`, the same object, imported on first use. So a checkpoint that pickled a class under
its old path (a model built from Python with `LoraSettings(...)`), and a config whose `class_path` names one
(`interleave_model.callbacks.CurriculumCallback`), still load. New code and docs use the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

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


def old_path(cls: type) -> str | None:
    """The dotted path a class had before its module moved (`interleave_model.policy.LoraSettings`), or None."""
    where = cls.__module__.removeprefix(f"{__name__}.")
    return next((f"{__name__}.{old}.{cls.__qualname__}" for old, new in MOVED.items() if new == where), None)


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `interleave_model.<old name>` and hands back the moved module itself (not a second copy of it)."""

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, name = fullname.partition(".")
        return importlib.util.spec_from_loader(fullname, self) if package == __name__ and name in MOVED else None

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.partition('.')[2]]}")

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran when it was imported under its new name."""


sys.meta_path.append(_OldNames())

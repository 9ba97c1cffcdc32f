"""Keep torch add-on packages that are installed but cannot load from breaking every import of transformers.

vLLM's CPU wheel pulls in torchvision, torchaudio and torchcodec, and the wheels pip finds for them are built against
the CUDA torch: next to the CPU torch they fail at import (`operator torchvision::nms does not exist`). transformers,
torchmetrics and so Lightning import them whenever they look installed, so without this shield a machine that ran
`pip install -e ".[test]"` could not even import Lightning. `interleave_model` runs it as it is imported; `cli.py` and
the tests import `interleave_model` before anything else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys

ADDONS = ("torchvision", "torchaudio", "torchcodec")


class _HiddenDistributions(importlib.abc.MetaPathFinder):
    """Tells `importlib.metadata` that hidden packages are not installed (torchmetrics asks it, not the importer)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("_", "-") in self.names:
            raise importlib.metadata.PackageNotFoundError(name)
        return iter(())


_HIDDEN = _HiddenDistributions()


def shield_broken_addons() -> list[str]:
    """Hide each add-on that is installed but fails to import; returns the names hidden (by this call or before).

    A hidden package is `None` in `sys.modules`, so `import torchvision` raises ImportError and
    `importlib.util.find_spec` reports it absent, and `importlib.metadata` finds no distribution of it: every way
    transformers, torchmetrics and vLLM look for it says it is not installed, and they do without it.
    """
    for name in ADDONS:
        if _broken(name):
            for loaded in [module for module in sys.modules if module == name or module.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = None
            _HIDDEN.names.add(name)
    if _HIDDEN.names and _HIDDEN not in sys.meta_path:
        sys.meta_path.insert(0, _HIDDEN)
        if "transformers" in sys.modules:
            # transformers caches what it found installed; a cache filled before the shield still says "available"
            from interleave_model.compat import forget_transformers_availability  # imports Lightning: only now

            forget_transformers_availability(_HIDDEN.names)
    return sorted(_HIDDEN.names)


def _broken(name: str) -> bool:
    """True when package `name` is installed, not imported yet, and fails to import."""
    if name in sys.modules or importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
        return False
    except (ImportError, OSError, RuntimeError):
        return True

"""The shield: an installed package that fails to import looks absent to the importer and to importlib.metadata."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest

from interleave_model import shield


@pytest.fixture
def broken_package(tmp_path, monkeypatch):
    """`brokenaddon` 1.0, installed (a dist-info) but raising at import, as a CUDA-built torchvision does on CPU."""
    package, info = tmp_path / "brokenaddon", tmp_path / "brokenaddon-1.0.dist-info"
    package.mkdir()
    info.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('operator brokenaddon::nms does not exist')\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenaddon\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hidden = shield._HiddenDistributions()
    monkeypatch.setattr(shield, "_HIDDEN", hidden)
    monkeypatch.setattr(shield, "ADDONS", ("brokenaddon",))
    yield "brokenaddon"
    if hidden in sys.meta_path:
        sys.meta_path.remove(hidden)
    sys.modules.pop("brokenaddon", None)


def test_a_broken_addon_is_hidden_everywhere_transformers_and_torchmetrics_look(broken_package):
    assert importlib.metadata.version(broken_package) == "1.0"  # installed, as far as pip knows

    assert shield.shield_broken_addons() == [broken_package]

    assert importlib.util.find_spec(broken_package) is None  # transformers' is_*_available
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version(broken_package)  # torchmetrics' RequirementCache
    with pytest.raises(ImportError):
        __import__(broken_package)
    assert shield.shield_broken_addons() == [broken_package]  # a second call changes nothing


def test_a_working_or_absent_addon_is_left_alone(monkeypatch):
    monkeypatch.setattr(shield, "_HIDDEN", shield._HiddenDistributions())
    monkeypatch.setattr(shield, "ADDONS", ("json", "no_such_addon_anywhere"))
    assert shield.shield_broken_addons() == []
    assert sys.modules["json"] is not None

"""The test install leaves an environment that a user's own scripts can use, not only processes that import the project
first: Lightning, transformers, peft and TensorBoard load in a fresh interpreter (tests/remove_broken_addons.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.remove_broken_addons import import_error

LIBRARIES = ("import lightning; from transformers import LlamaConfig; import peft; import tensorboard; "
             "from torch.utils.tensorboard import SummaryWriter")  # fmt: skip


def test_a_fresh_interpreter_that_never_imports_the_project_loads_the_libraries(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LIBRARIES], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_addon_that_fails_to_load_is_found_and_one_that_loads_is_not(tmp_path, monkeypatch):
    """`brokenaddon` is installed but raises at import, as a CUDA-built torchvision does next to the CPU torch."""
    package = tmp_path / "brokenaddon"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('operator brokenaddon::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    assert import_error("brokenaddon") == "RuntimeError: operator brokenaddon::nms does not exist"
    assert import_error("json") is None
    assert import_error("no_such_addon_anywhere") is None

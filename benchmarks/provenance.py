"""What every benchmark's JSON line carries, so that a reader can trace a figure: the command that printed it, the
commit it ran, and the machine (Python, torch, CPU model, threads)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path


def provenance(threads: int | None = None) -> dict[str, object]:
    """The command line, the commit the benchmark started from (`STARTED_AT`), Python, torch, the CPU's model name
    and torch's thread count (`threads` when the caller set another)."""
    import torch  # here, not above: `vs_trl.py`'s TRL worker imports the benchmarks' helpers before anything heavy

    return {
        "command": " ".join(["python", *sys.argv]),
        "commit": STARTED_AT,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "threads": threads or torch.get_num_threads(),
    }


def commit_of(tree: Path) -> str | None:
    """The commit checked out at `tree`, `+dirty` when its tracked files differ from it; None outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the checkout's commit when a benchmark imported this module, at its start ("+dirty" when tracked files differ from
# it; None outside a git checkout): a run of an hour prints its line after later commits may have landed
STARTED_AT = commit_of(Path(__file__).parent)

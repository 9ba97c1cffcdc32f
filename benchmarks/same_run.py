"""Behaviour unchanged, checked: the same short fit run from two checkouts (a commit before a refactor and one after,
e.g. `git worktree add --detach ../before <commit>`), every logged scalar compared point by point (timings left out).
One JSON line: the two commits, how many scalars and points were compared and which differ (none, when the change
kept every number).

    python benchmarks/same_run.py --before ../before --after . --out benchmarks/results/same-run.jsonl
    python benchmarks/same_run.py --before ../before --after . -- --trainer.max_steps 60   # other fit arguments

The default fit is the demo's warm start to its end and GRPO's first 30 steps, with a held-out check at step 310
(`configs/demo.yaml`, one thread): every phase of a step and the check, in a few minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from provenance import commit_of, provenance

DEMO = ["--config", "configs/demo.yaml", "--trainer.max_steps", "330", "--trainer.val_check_interval", "310"]


def scalars(tree: Path, fit_args: list[str], root: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar but `time/*` a fit from `tree` (its own code first on the path) logs: `{tag: [(step, value)]}`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = os.environ | harness.OFFLINE | {"PYTHONPATH": str(tree)}
    command = [sys.executable, "cli.py", "fit", *fit_args, "--trainer.default_root_dir", str(root),
               "--trainer.enable_progress_bar", "false"]  # fmt: skip
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: the fit from {tree} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    (run,) = root.glob("lightning_logs/*/version_*")
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if not tag.startswith("time/")]
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the commit before the change")
    parser.add_argument("--after", type=Path, required=True, help="checkout of the commit after it")
    parser.add_argument("--out", default=None, help="append the JSON line to this file as well")
    args, rest = parser.parse_known_args()
    fit_args = rest[1:] if rest[:1] == ["--"] else rest
    fit_args = DEMO + fit_args
    with tempfile.TemporaryDirectory() as scratch:
        before = scalars(args.before.resolve(), fit_args, Path(scratch, "before"))
        after = scalars(args.after.resolve(), fit_args, Path(scratch, "after"))
    differ = sorted(tag for tag in before.keys() | after.keys() if before.get(tag) != after.get(tag))
    line = {"benchmark": "same_run", "before": commit_of(args.before), "after": commit_of(args.after),
            "fit": fit_args, "scalars": len(before), "points": sum(map(len, before.values())),
            "last_step": max((step for points in before.values() for step, _ in points), default=None),
            "differ": differ}  # fmt: skip
    harness.emit(line | provenance(), args.out)


if __name__ == "__main__":
    main()

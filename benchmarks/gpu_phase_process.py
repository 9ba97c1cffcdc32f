"""A process of `gpu_check.py` that runs phases: each under its time guard, its record (or its error) appended to the
records file as soon as it ends, so that the check has every line a phase wrote however the process ends.

Imports the standard library only at import, as `gpu_check.py` does.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import harness
from gpu_phases import PHASES, identity


class PhaseTimeout(Exception):
    """A phase ran past its time guard."""


@contextmanager
def time_guard(seconds: float):
    """Raise `PhaseTimeout` in this (main) thread after `seconds`; code inside a C call sees it on its return, and the
    orchestrator kills the process past its grace."""
    seconds = max(seconds, 1.0)

    def expire(signum, frame):
        raise PhaseTimeout(f"ran past its time guard of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_phases(phases: list[str], until: float, smoke: bool, work: Path, records: Path,
               budgets: dict[str, float]) -> int:  # fmt: skip
    """Run each named phase under its guard (its budget in `budgets`, none past `until`) and append its record (or its
    error) to `records` at once.

    A phase stopped by its guard may leave this process half-way through anything (an import, an engine), so the
    phases after it in the same process are not run, and say so."""
    harness.offline()
    if smoke:
        import torch

        torch.set_num_threads(1)  # a tiny model runs faster on one thread, and far faster on a shared CPU
    stopped = None
    for phase in phases:
        started = time.perf_counter()
        if stopped:
            record = {"error": f"not run: {stopped} ran past its time guard in the same process"}
        else:
            try:
                with time_guard(min(budgets.get(phase, float("inf")), until - time.time())):
                    record = PHASES[phase](smoke, work)
            except Exception as err:  # recorded in the line; the next phase runs
                traceback.print_exc()
                text = str(err).strip().splitlines()
                record = {"error": f"{type(err).__name__}: {text[0] if text else ''}"[:500]}
                stopped = phase if isinstance(err, PhaseTimeout) else None
        record = identity(phase) | record | {"seconds": round(time.perf_counter() - started, 1)}
        with open(records, "a") as file:
            file.write(json.dumps(record) + "\n")
        release()
    return 0


def release() -> None:
    """Free what a finished phase held, for the next phase in this process."""
    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

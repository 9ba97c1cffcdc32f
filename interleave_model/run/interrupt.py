"""Stopping a run from outside: SIGTERM (`kill`, a scheduler's time limit) or Ctrl-C saves what a fit learned and ends
the process with the signal's exit status.

Lightning stops at the next step boundary on SIGTERM, by raising `SIGTERMException`: a `SystemExit` without a code, so
the process exits 0, as if the run had ended, and a fit saves nothing since its last periodic checkpoint. With
`StopOnSignal` (the CLI adds it to every run) a stopped fit saves `last.ckpt` into the run's `checkpoints/`, where
`--ckpt_path last` finds it, says so in one line, and exits 128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C),
what a shell reports for a process the signal ended.

Ctrl-C takes the same path: the first asks the run to stop after the step it is in (a step of a real model on a CPU
can last a minute), a second stops at once and saves nothing (Lightning's own handling of Ctrl-C).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override


class StopOnSignal(L.Callback):
    """Turn a SIGTERM or a first Ctrl-C into a stop after the current step: a fit saves `last.ckpt`, the exit status is
    128 + the signal's number."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the signal that stopped the run
        self._previous = None  # the SIGINT handler before the fit's

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Listen for Ctrl-C. Lightning has taken every signal's handler by now and puts them back when the run ends,
        this one included."""
        self.signal = None
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:  # a job started in the background ignores Ctrl-C: so does the run
                self._previous = previous
                signal.signal(signal.SIGINT, self._interrupt)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._previous = None  # a Ctrl-C from here on is the previous handler's
        if not isinstance(exception, SIGTERMException):
            return
        self.signal = self.signal or signal.SIGTERM
        exception.code = 128 + self.signal  # SIGTERMException is a SystemExit: its code is the process's exit status
        name = signal.Signals(self.signal).name
        if trainer.state.fn != TrainerFn.FITTING:
            rank_zero_info(f"{trainer.state.fn.value} stopped by {name}: nothing saved")
            return
        saved = save_last(trainer)
        where = f"saved {saved}; the same command with --ckpt_path last goes on from it" if saved else "nothing saved"
        rank_zero_info(f"fit stopped by {name} after step {trainer.global_step}: {where}")

    def _interrupt(self, signum: int, frame) -> None:
        """SIGINT: the first one during a run stops it as SIGTERM does (Lightning's handler, which a DDP run shares
        across its ranks); any other is the previous handler's (Python's raises KeyboardInterrupt)."""
        stop = signal.getsignal(signal.SIGTERM)
        if self._previous is None or self.signal is not None or not callable(stop):
            previous = self._previous if callable(self._previous) else signal.default_int_handler
            previous(signum, frame)
            return
        self.signal = signal.SIGINT
        rank_zero_info("Ctrl-C: stopping after this step and saving it; Ctrl-C again stops now, without saving")
        stop(signal.SIGTERM, frame)


def save_last(trainer: L.Trainer) -> Path | None:
    """Save the run's state as `last.ckpt` in its ModelCheckpoint's folder; None when the run has no ModelCheckpoint.

    Call it on every rank, as `Trainer.save_checkpoint` is.
    """
    checkpoint = trainer.checkpoint_callback
    if checkpoint is None or checkpoint.dirpath is None:
        return None
    path = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
    trainer.save_checkpoint(path, weights_only=checkpoint.save_weights_only)
    return path

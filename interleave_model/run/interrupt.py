"""Stopping a fit from outside: SIGTERM (`kill`, a scheduler's time limit) or Ctrl-C ends it after the step under way,
saves that step and exits with the signal's status.

Lightning's own handling falls short twice. On one process it stops at the next step boundary by raising
`SIGTERMException`, a `SystemExit` without a code: the process exits 0, as if the run had ended, and saves nothing
since its last periodic checkpoint. Under DDP its handler runs a collective (a broadcast) inside the signal handler;
a rank that gets the signal twice (from the scheduler and from rank 0's forwarding) or in the middle of another
collective leaves the ranks waiting on each other for good (two CPU ranks hung this way on SIGTERM).

`StopOnSignal` (the CLI adds it to every run) replaces both handlers for the length of the fit with one that only
notes the signal. At the end of every training step the ranks agree, in one reduction, whether any rank was signalled;
if so every rank raises `SIGTERMException` at that same point, the run's state is saved as `last.ckpt` in its
`checkpoints/`, where `--ckpt_path last` finds it, one line says so, and the process exits 128 + the signal's number
(143 for SIGTERM, 130 for Ctrl-C), what a shell reports for a process a signal ended. A second Ctrl-C stops at once
and saves nothing (Lightning's handling of KeyboardInterrupt, exit status 1): it may fall in the middle of an update.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal(L.Callback):
    """End a fit after its current step on SIGTERM or a first Ctrl-C, on every rank together, saving `last.ckpt`; the
    exit status is 128 + the signal's number."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the signal that stops the run, once one came
        self._previous: dict[int, object] = {}  # each signal's handler before the fit's
        self._speaks = True  # rank 0 says what it does

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Listen. Lightning has taken every signal's handler by now and puts them back when the run ends."""
        self.signal, self._previous, self._speaks = None, {}, trainer.is_global_zero
        if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
            return
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if previous is not signal.SIG_IGN:  # a job started in the background ignores Ctrl-C: so does the run
                self._previous[signum] = previous
                signal.signal(signum, self._note)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.strategy.reduce_boolean_decision(self.signal is not None, all=False):  # any rank signalled
            raise SIGTERMException

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        stopped_by = self.signal or signal.SIGTERM  # a rank that was not signalled itself stops as for SIGTERM
        exception.code = 128 + stopped_by  # SIGTERMException is a SystemExit: its code is the process's exit status
        name = signal.Signals(stopped_by).name
        if trainer.state.fn != TrainerFn.FITTING:
            rank_zero_info(f"{trainer.state.fn.value} stopped by {name}: nothing saved")
            return
        saved = save_last(trainer)
        where = f"saved {saved}; the same command with --ckpt_path last goes on from it" if saved else "nothing saved"
        rank_zero_info(f"fit stopped by {name} after step {trainer.global_step}: {where}")

    def _note(self, signum: int, frame) -> None:
        """The handler: note the signal and let the step finish; a second Ctrl-C is the previous handler's."""
        if self.signal is not None:
            if signum == signal.SIGINT:
                previous = self._previous.get(signum)
                (previous if callable(previous) else signal.default_int_handler)(signum, frame)
            return
        self.signal = signum
        said = "Ctrl-C: stopping after this step and saving it; Ctrl-C again stops now, unsaved"
        if signum != signal.SIGINT:
            said = f"{signal.Signals(signum).name}: stopping after this step and saving it"
        if self._speaks:
            print(said, file=sys.stderr, flush=True)


def save_last(trainer: L.Trainer, alone: bool = False) -> Path | None:
    """Save the run's state as `last.ckpt` in its ModelCheckpoint's folder; None when the run has no ModelCheckpoint.

    Call it on every rank, as `Trainer.save_checkpoint` is. With `alone`, one rank calls it while the others may be
    anywhere, in a collective of their own among them: rank 0 writes, with no collective (no barrier after the
    write), and any other rank writes nothing and gets None. Only for a strategy whose rank 0 holds the whole state
    (one device, DDP).
    """
    checkpoint = trainer.checkpoint_callback
    if checkpoint is None or checkpoint.dirpath is None:
        return None
    path = Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
    if not alone:
        trainer.save_checkpoint(path, weights_only=checkpoint.save_weights_only)
        return path
    if not trainer.is_global_zero:
        return None
    # Trainer.save_checkpoint (lightning 2.6.6) is this dump, the strategy's write (rank 0's) and then a barrier
    state = trainer._checkpoint_connector.dump_checkpoint(checkpoint.save_weights_only)
    trainer.strategy.save_checkpoint(state, path)
    return path

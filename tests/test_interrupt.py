"""SIGTERM and Ctrl-C: a fit stops after the step it is in, saves `last.ckpt`, exits 128 + the signal's number, and
`--ckpt_path last` goes on from the saved step."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from cli import main, run
from tests.conftest import TINY_CONFIG
from tests.test_requeue import RUN_CONFIG, Signal


@pytest.fixture(autouse=True)
def python_ctrl_c():
    """Ctrl-C as an interactive Python has it (a test worker may ignore it), the caller's handler back afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _args(tmp_path) -> list[str]:
    config = tmp_path / "run.yaml"
    config.write_text(RUN_CONFIG.replace("every_n_train_steps: 4", "every_n_train_steps: 100"))
    return ["fit", "--config", str(TINY_CONFIG), "--config", str(config), f"--trainer.default_root_dir={tmp_path}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.limit_val_batches=0", "--trainer.max_steps=6",
            "--trainer.callbacks+=tests.test_requeue.Signal"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_saves_the_step_exits_with_its_status_and_last_goes_on(tmp_path, signum, caplog):
    args = _args(tmp_path)
    caplog.set_level(logging.INFO)

    with pytest.raises(SystemExit) as stopped:
        run([*args, f"--trainer.callbacks.signum={int(signum)}", "--trainer.callbacks.at=2"])

    assert stopped.value.code == 128 + signum  # 143, 130: not 0, which says the run ended
    saved = {p.name: torch.load(p, weights_only=False)["global_step"] for p in tmp_path.rglob("*.ckpt")}
    assert saved == {"last.ckpt": 3}  # the step the signal fell in was finished, then saved; no periodic save was due
    assert f"fit stopped by {signum.name} after step 3: saved " in caplog.text
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is the caller's again

    cli = main([*args, "--ckpt_path=last"])

    resumed = next(c for c in cli.trainer.callbacks if isinstance(c, Signal))
    assert resumed.first_step == 3 and cli.trainer.global_step == 6


class SendTwice(Signal):
    """Two Ctrl-C in a row, as an impatient user presses them."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_saves_nothing(tmp_path):
    args = [*_args(tmp_path), "--trainer.callbacks+=tests.test_interrupt.SendTwice", "--trainer.callbacks.at=2"]
    args.remove("--trainer.callbacks+=tests.test_requeue.Signal")

    with pytest.raises(SystemExit) as stopped:
        run(args)

    assert stopped.value.code == 1  # Lightning's answer to KeyboardInterrupt
    assert not list(tmp_path.rglob("*.ckpt"))

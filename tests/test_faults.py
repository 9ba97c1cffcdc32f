"""SIGKILL safety: a checkpoint is written to a temporary file and renamed, so a kill never leaves a torn one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cli import main
from interleave_model.model.checkpoint import AtomicCheckpointIO
from tests.conftest import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

# Saves version 1, then starts saving version 2 and is SIGKILLed once half of its bytes are on disk.
KILLED_WRITER = textwrap.dedent(
    """
    import io, os, signal, sys
    import torch
    from interleave_model.model.checkpoint import AtomicCheckpointIO

    path, plugin = sys.argv[1], AtomicCheckpointIO()
    plugin.save_checkpoint({"version": 1, "weights": torch.arange(1000)}, path)
    real_save = torch.save

    def save_half_then_die(obj, f):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_half_then_die
    plugin.save_checkpoint({"version": 2, "weights": torch.arange(1000) * 2}, path)
    """
)


@pytest.mark.slow
def test_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path):
    path = tmp_path / "last.ckpt"

    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], cwd=ROOT, env=ENV, timeout=120)

    assert done.returncode == -signal.SIGKILL
    assert torch.load(path, weights_only=False)["version"] == 1  # the old file, whole
    assert (tmp_path / ".last.ckpt.tmp").exists()  # the torn bytes went to the temporary file only
    AtomicCheckpointIO().save_checkpoint({"version": 3}, path)
    assert torch.load(path, weights_only=False) == {"version": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a.ckpt"
    AtomicCheckpointIO().save_checkpoint({"version": 1}, path)

    def broken(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        AtomicCheckpointIO().save_checkpoint({"version": 2}, path)
    monkeypatch.undo()

    assert torch.load(path, weights_only=False) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sigkill_during_training_resumes_from_the_last_complete_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    command = [
        sys.executable, "cli.py", "fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false", "--trainer.max_steps=500", "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpt}",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}",
        "--trainer.callbacks+=interleave_model.run.callbacks.CurriculumCallback", "--trainer.callbacks.export=false",
        "--trainer.plugins+=interleave_model.model.checkpoint.AtomicCheckpointIO",
    ]  # fmt: skip
    run = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 150
        while not (ckpt / "step=4.ckpt").exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.poll() is None, "training ended before it could be killed"
        time.sleep(0.3)  # somewhere in a later step, possibly in the middle of a write
        run.send_signal(signal.SIGKILL)
        assert run.wait(timeout=30) == -signal.SIGKILL
    finally:
        if run.poll() is None:
            run.kill()

    steps = sorted(torch.load(p, weights_only=False)["global_step"] for p in ckpt.glob("step=*.ckpt"))
    assert steps == list(range(1, len(steps) + 1))  # every checkpoint file is whole
    last = torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"]
    assert 4 <= last and last in (steps[-1], steps[-1] - 1)  # the kill may fall between step=N.ckpt and last.ckpt

    resumed = main([
        "fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path / 'resumed'}",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
        f"--trainer.max_steps={last + 2}", "--trainer.callbacks+=interleave_model.run.callbacks.CurriculumCallback",
        f"--ckpt_path={ckpt / 'last.ckpt'}",
    ])  # fmt: skip
    assert resumed.trainer.global_step == last + 2

"""SLURM requeue: SIGUSR1 saves the run's state in its folder, and the requeued `fit --ckpt_path last` goes on from it.

The run is a CPU fit under SLURM's variables, so Lightning's SLURMEnvironment handles the signal; `scontrol` is a
stand-in that records the requeue and kills the job, as SLURM does when it requeues a running job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from cli import main
from tests.conftest import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[1]
SLURM = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "fit", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}  # fmt: skip
# what `scontrol requeue` does to a running job: it ends (SLURM sends SIGTERM, then SIGKILL)
SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\nkill -KILL $PPID\n'
# the shipped configs' saving: a run folder, a periodic last.ckpt, atomic writes
RUN_CONFIG = """
trainer:
  logger: {class_path: interleave_model.run.runs.RunLogger, init_args: {name: tiny}}
  plugins: [interleave_model.model.checkpoint.AtomicCheckpointIO]
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, save_top_k: 0, every_n_train_steps: 4}
"""


class Signal(L.Callback):
    """Sends this process `signum` (SLURM's warning SIGUSR1 by default) as the step after `at` begins, mid-step, on
    rank `rank` only or on every rank (None); notes the first step a run makes."""

    def __init__(self, at: int | None = None, signum: int = int(signal.SIGUSR1), rank: int | None = None):
        self.at, self.signum, self.rank = at, signum, rank
        self.first_step = None

    def on_train_start(self, trainer, pl_module):
        self.first_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sigusr1_then_ckpt_path_last_resumes_from_the_requeue_save(tmp_path, monkeypatch):
    bin_dir, config = tmp_path / "bin", tmp_path / "run.yaml"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    config.write_text(RUN_CONFIG)
    root = tmp_path / "root"
    env = SLURM | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SCONTROL_LOG": str(tmp_path / "scontrol.log")}
    # the documented job script's command, as the first and the requeued job run it
    args = ["fit", "--config", str(TINY_CONFIG), "--config", str(config), f"--trainer.default_root_dir={root}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.limit_val_batches=0", "--trainer.max_steps=6",
            "--ckpt_path=last", "--trainer.callbacks+=tests.test_requeue.Signal"]  # fmt: skip

    first = subprocess.run(
        [sys.executable, "cli.py", *args, "--trainer.callbacks.at=5"], cwd=ROOT, timeout=300,
        env=os.environ | env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
    )  # fmt: skip

    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    run = root / "lightning_logs" / "tiny" / "version_0"
    saved = {p.name: torch.load(p, weights_only=False)["global_step"] for p in root.rglob("*.ckpt")}
    assert saved == {"last.ckpt": 4, "hpc_ckpt_1.ckpt": 5}  # the periodic save, and the one SIGUSR1 made
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["hpc_ckpt_1.ckpt", "last.ckpt"]

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cli = main(args)

    assert cli.trainer.ckpt_path == str(run / "checkpoints" / "hpc_ckpt_1.ckpt")
    resumed = next(c for c in cli.trainer.callbacks if isinstance(c, Signal))
    assert resumed.first_step == 5 and cli.trainer.global_step == 6  # nothing done before the signal is lost
    assert Path(cli.trainer.log_dir) == run  # the same run goes on

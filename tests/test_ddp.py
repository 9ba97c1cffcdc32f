"""DDP on CPU (gloo), two ranks, through the real command line; then the checkpoint resumes on one process.

The curriculum moves after the first GRPO batch, so the ranks must agree on a move, not only on standing still.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from cli import main
from interleave_model.callbacks import CurriculumCallback
from tests.conftest import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[1]


class RankReport(L.Callback):
    """Writes what this rank saw at the end of fit to `<folder>/rank<r>.json`."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_end(self, trainer, pl_module):
        curriculum = next(c for c in trainer.callbacks if type(c).__name__ == "CurriculumCallback")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("curriculum/", "val/"))}
        weights = torch.cat([p.detach().flatten().double() for p in pl_module.policy.parameters()])
        report = {
            "curriculum": curriculum.state_dict(),
            "datamodule": trainer.datamodule.state_dict(),
            "temperature": pl_module.hparams.temperature,
            "metrics": metrics,
            "weights": [weights.sum().item(), weights.abs().sum().item()],
            "global_step": trainer.global_step,
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, sort_keys=True))


def _callbacks(tmp_path: Path) -> list[dict]:
    curriculum = {"threshold": 0.0, "patience": 1, "min_steps": 1, "window": 2}
    return [
        {"class_path": "interleave_model.callbacks.CurriculumCallback", "init_args": curriculum},
        {"class_path": "interleave_model.callbacks.SampleDump", "init_args": {"every_n_steps": 1}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "save_top_k": 0}},
        {"class_path": "tests.test_ddp.RankReport", "init_args": {"folder": str(tmp_path / "ranks")}},
    ]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_cpu_ranks_agree_write_one_sample_log_and_resume(tmp_path):
    extra = tmp_path / "ddp.yaml"
    trainer = {
        "devices": 2, "strategy": "ddp", "max_steps": 5, "val_check_interval": 4, "limit_val_batches": 1,
        "default_root_dir": str(tmp_path), "callbacks": _callbacks(tmp_path),
        "plugins": [{"class_path": "interleave_model.checkpoint.AtomicCheckpointIO"}],
    }  # fmt: skip
    extra.write_text(yaml.safe_dump({"trainer": trainer}))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "cli.py", "fit", "--config", str(TINY_CONFIG), "--config", str(extra)]

    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)

    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1  # same decisions, curriculum and datamodule state, synced metrics, same weights
    kinds = [h["kind"] for h in rank0["curriculum"]["history"]]
    assert kinds == ["advance", "done"] and rank0["curriculum"]["stage_index"] == 1
    assert {"curriculum/reward", "curriculum/stage_words", "val/alignment_4w"} <= rank0["metrics"].keys()

    logs = list(tmp_path.rglob("samples.log"))
    assert len(logs) == 1
    heads = [line for line in logs[0].read_text().splitlines() if line.startswith("===")]
    assert len(heads) == 2 * 3  # best and worst once per GRPO batch (batches 2-4), from rank 0 only
    assert len(list(tmp_path.rglob("stages/*words/model.safetensors"))) == 2

    resumed = main([
        "fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path / 'resumed'}",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
        "--trainer.max_steps=7", "--trainer.callbacks+=interleave_model.callbacks.CurriculumCallback",
        f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}",
    ])  # fmt: skip
    assert resumed.trainer.global_step == 7
    restored = next(c for c in resumed.trainer.callbacks if isinstance(c, CurriculumCallback)).state
    assert restored.history == rank0["curriculum"]["history"] and restored.stage_index == 1

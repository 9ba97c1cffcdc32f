"""Run placement on parsed configs: `last` is the last.ckpt written last, and a resumed fit pins its run's version."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from interleave_model.run.runs import RunError, config_filename, place_run


def _config(root: Path, logger, ckpt_path: str | None) -> Namespace:
    return Namespace(trainer=Namespace(default_root_dir=str(root), logger=logger), ckpt_path=ckpt_path)


def _checkpoint(folder: Path, mtime: int) -> Path:
    path = folder / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"global_step": 7}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_last_is_the_checkpoint_written_last_and_fit_continues_its_run(tmp_path):
    runs = tmp_path / "lightning_logs" / "demo"
    _checkpoint(runs / "version_0", mtime=2_000)  # continued by hand after version_1 was made
    _checkpoint(runs / "version_1", mtime=1_000)
    (runs / "version_2").mkdir()  # an evaluation run: no checkpoint
    logger = Namespace(
        class_path="interleave_model.run.runs.RunLogger", init_args=Namespace(save_dir=None, name="demo")
    )
    config = _config(tmp_path, logger, "last")

    assert place_run(config, "fit") == runs / "version_0"
    assert config.ckpt_path == str(runs / "version_0" / "checkpoints" / "last.ckpt")
    # version 0's checkpoint was saved at step 7: TensorBoard drops what that run logged from step 8 on
    init_args = Namespace(save_dir=str(tmp_path / "lightning_logs"), name="demo", version=0, purge_step=8)
    assert config.trainer.logger.init_args == init_args


def test_lightnings_default_logger_is_made_explicit_to_continue_its_run(tmp_path):
    checkpoint = _checkpoint(tmp_path / "lightning_logs" / "version_3", mtime=1_000)
    config = _config(tmp_path, True, str(checkpoint))

    assert place_run(config, "fit") == tmp_path / "lightning_logs" / "version_3"
    init_args = Namespace(save_dir=str(tmp_path), name="lightning_logs", version=3, purge_step=8)
    assert config.trainer.logger.init_args == init_args


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_an_evaluation_reads_last_but_writes_a_run_of_its_own(tmp_path, subcommand):
    checkpoint = _checkpoint(tmp_path / "lightning_logs" / "version_0", mtime=1_000)
    config = _config(tmp_path, True, "last")

    assert place_run(config, subcommand) is None
    assert config.ckpt_path == str(checkpoint) and config.trainer.logger is True
    with pytest.raises(RunError, match="no run under"):
        place_run(_config(tmp_path / "empty", True, "last"), subcommand)


def test_a_checkpoint_outside_the_configs_runs_starts_a_new_run(tmp_path):
    elsewhere = _checkpoint(tmp_path / "other" / "version_0", mtime=1_000)
    config = _config(tmp_path, True, str(elsewhere))
    assert place_run(config, "fit") is None and config.trainer.logger is True


def test_a_resume_keeps_the_first_config_and_writes_the_next_beside_it(tmp_path):
    assert config_filename(tmp_path) == "config.yaml"
    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "config-resume-1.yaml").write_text("")
    assert config_filename(tmp_path) == "config-resume-2.yaml"

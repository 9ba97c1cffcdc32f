"""Checkpoints are read without running code: a file that pickles a command is refused in one line, not executed."""

import os

import pytest
import torch

from cli import run
from tests.conftest import TINY_CONFIG


class Command:
    """Unpickling this runs `touch <marker>`, as a checkpoint crafted by someone else could."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("route", ["init_from", "export"])
def test_a_checkpoint_holding_a_command_is_refused_and_never_run(tmp_path, capsys, route):
    marker = tmp_path / "ran"
    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "payload": Command(marker)}, bad)
    common = ["--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"]
    if route == "init_from":
        args = ["fit", *common, f"--model.base.init_from={bad}", "--trainer.max_steps=1"]
    else:
        args = ["export", *common, f"--ckpt_path={bad}", f"--output_dir={tmp_path / 'out'}"]

    assert run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "it was not loaded" in err[0], err
    assert "system" in err[0] and not marker.exists()


def test_the_checkpoints_the_project_writes_load_safely(tmp_path):
    from cli import main

    cli = main(["fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
                "--trainer.max_steps=3"])  # fmt: skip
    cli.trainer.save_checkpoint(tmp_path / "own.ckpt")
    own = tmp_path / "own.ckpt"
    resumed = main(["fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}",
                    "--trainer.logger=false", "--trainer.max_steps=3", f"--model.base.init_from={own}",
                    "--data.sft_steps=0"])  # fmt: skip
    assert resumed.trainer.global_step == 3

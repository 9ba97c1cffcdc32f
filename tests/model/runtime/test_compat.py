"""CompatCLI reads a checkpoint's hyperparameters through `checkpoint_hparams`, which a CLI overrides to migrate."""

from __future__ import annotations

import pytest
import torch
from lightning import LightningModule

from interleave_model.runtime.compat import CompatCLI


class Net(LightningModule):
    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()


class Parsed(Exception):
    """Stops the CLI once the config is parsed, carrying the model's settings."""


class StopAfterParsing(CompatCLI):
    def before_instantiate_classes(self) -> None:
        raise Parsed(self.config.validate.model)


class RenamingCLI(StopAfterParsing):
    """Migrates an older checkpoint that saved `width` as `size`."""

    def checkpoint_hparams(self, hparams: dict) -> dict:
        return {"width" if key == "size" else key: value for key, value in super().checkpoint_hparams(hparams).items()}


def _parse(cli: type[CompatCLI], hparams: dict, tmp_path) -> dict:
    path = tmp_path / "old.ckpt"
    torch.save({"hyper_parameters": hparams}, path)
    with pytest.raises(Parsed) as parsed:
        cli(Net, args=["validate", f"--ckpt_path={path}", "--trainer.logger=false", "--seed_everything=false"])
    return parsed.value.args[0]


def test_the_checkpoint_hparams_hook_rewrites_what_the_checkpoint_saved(tmp_path):
    assert _parse(RenamingCLI, {"size": 5}, tmp_path).width == 5


def test_by_default_the_checkpoint_hparams_update_the_config_as_saved(tmp_path, capsys):
    assert _parse(StopAfterParsing, {"width": 7}, tmp_path).width == 7
    with pytest.raises(SystemExit):  # an older name the module no longer takes, and no hook to migrate it
        _parse(StopAfterParsing, {"size": 5}, tmp_path)
    assert "Parsing of ckpt_path hyperparameters failed" in capsys.readouterr().err

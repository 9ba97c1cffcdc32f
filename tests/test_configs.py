"""Every shipped config parses against the code that reads it, so no config can rot."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cli import main

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_configs_are_shipped():
    assert {"demo.yaml", "llama-3.2-3b.yaml"} <= {c.name for c in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_prints(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {"trainer", "model", "data"} <= printed.keys()
    # the curriculum's policy is one group of data settings; the tokenizer is linked from the model, not a key
    assert "on_collapse" in printed["data"]["curriculum"] and "tokenizer" not in printed["data"]

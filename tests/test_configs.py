"""Every shipped config parses against the code that reads it, and every setting the docs name is one, so neither can
rot."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cli import main
from interleave_data.datamodule import InterleaveDataModule
from interleave_model.module import InterleaveGRPO

ROOT = Path(__file__).parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a setting as the docs write it: `model.loss.beta`, --data.stages=[10], --trainer.callbacks+=...; the lookbehind
# leaves out module paths (interleave_model.model.checkpoint) and file names (adapter_model.safetensors)
SETTING = re.compile(r"(?<![\w.])(?:model|data|trainer)(?:\.[A-Za-z_]\w*)+")
# dotted names the docs give to what is not a setting: the Trainer's run folder (a property), the tokenizer the CLI
# hands from the built model to the data module, the weights file of an exported model folder
NOT_SETTINGS = {"trainer.log_dir", "model.tokenizer", "data.tokenizer", "model.safetensors"}
ATOMIC = "interleave_model.model.checkpoint.AtomicCheckpointIO"


def test_configs_are_shipped():
    assert {"demo.yaml", "llama-3.2-3b.yaml", "llama-3.2-3b-curriculum.yaml"} <= {c.name for c in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_prints(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {"trainer", "model", "data"} <= printed.keys()
    # the curriculum's policy is one group of data settings; the tokenizer is linked from the model, not a key
    assert "on_collapse" in printed["data"]["curriculum"] and "tokenizer" not in printed["data"]


def _keys(tree: dict, prefix: str = "") -> Iterator[str]:
    """Every key of a printed config, groups included, as its dotted name."""
    for key, value in tree.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{key}.")


def _fields(name: str, hint: typing.Any) -> Iterator[str]:
    """The settings inside a group typed `hint` (a dataclass, alone or in a union with None), at any depth."""
    for group in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(group):
            hints = typing.get_type_hints(group)
            for field in dataclasses.fields(group):
                yield f"{name}.{field.name}"
                yield from _fields(f"{name}.{field.name}", hints[field.name])


@pytest.fixture(scope="module")
def settings() -> set[str]:
    """Every name `fit` takes: what `--print_config` prints, and the settings of the optional groups it prints as null
    (`model.lora.r` where the config leaves `model.lora` out)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "demo.yaml"), "--print_config"])
    names = set(_keys(yaml.safe_load(printed.getvalue())))
    for section, cls in (("model", InterleaveGRPO), ("data", InterleaveDataModule)):
        for arg, hint in typing.get_type_hints(cls.__init__).items():
            if f"{section}.{arg}" in names:
                names.update(_fields(f"{section}.{arg}", hint))
    return names


def documented_settings() -> dict[str, set[str]]:
    """Each dotted `model.` / `data.` / `trainer.` name in the README, docs/*.md and the configs' comments, with the
    files that give it."""
    texts = {path: path.read_text() for path in DOCS}
    texts |= {path: "\n".join(line.partition("#")[2] for line in path.read_text().splitlines()) for path in CONFIGS}
    named: dict[str, set[str]] = {}
    for path, text in texts.items():
        for name in SETTING.findall(text):
            named.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return named


def test_the_checker_knows_a_setting_from_a_misplaced_one(settings):
    # docs/SCALING.md once told users to set `model.micro_batch_size`, which fit refuses: it lives in a group
    assert "model.micro_batch_size" not in settings and "model.optimization.micro_batch_size" in settings
    # groups, their settings, the settings of groups the config leaves null, lists; not the CLI's link targets
    assert {"model.sampling", "model.sampling.temperature", "model.lora.r", "model.vllm.gpu_memory_utilization",
            "model.dynamic_sampling.max_rounds", "data.curriculum.window", "trainer.callbacks"} <= settings  # fmt: skip
    assert "model.corpus" not in settings  # linked from data.corpus
    text = "`--model.micro_batch_size=4`, data.stages[0], --trainer.callbacks+=X, interleave_model.model.checkpoint."
    assert SETTING.findall(text) == ["model.micro_batch_size", "data.stages", "trainer.callbacks"]


def test_every_setting_the_docs_name_exists(settings):
    named = documented_settings()
    assert len(named) > 20  # the scan found the docs' settings
    unknown = {name: sorted(where) for name, where in named.items() if name not in settings | NOT_SETTINGS}
    assert not unknown, f"not a setting of `python cli.py fit`: {unknown}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_a_config_that_checkpoints_writes_atomically(config):
    """A run killed mid-save must not leave a torn last.ckpt for `--ckpt_path last` to resume from."""
    trainer = yaml.safe_load(config.read_text()).get("trainer") or {}
    plugins = trainer.get("plugins") or []
    plugins = plugins if isinstance(plugins, list) else [plugins]
    plugins = [p["class_path"] if isinstance(p, dict) else p for p in plugins]
    assert trainer.get("enable_checkpointing") is False or ATOMIC in plugins


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_a_config_with_several_stages_has_the_callback_that_moves_between_them(config):
    """Without `CurriculumCallback` a multi-stage config trains its first stage for ever: nothing acts on the
    curriculum's decisions. A config for evaluation only (no `fit` among its commands) lists lengths to score."""
    text = config.read_text()
    tree = yaml.safe_load(text)
    stages = tree.get("data", {}).get("stages") or [10]
    callbacks = [c["class_path"] for c in tree["trainer"].get("callbacks") or []]
    if len(stages) > 1 and "cli.py fit" in text:
        assert "interleave_model.run.callbacks.CurriculumCallback" in callbacks


GPU_CONFIGS = [c for c in CONFIGS if c.name.startswith("llama-3.2-3b")]


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("subcommand", ["fit", "validate", "check"])
def test_the_3b_configs_ask_for_the_model_in_one_line(config, subcommand, tmp_path, capsys):
    """They ship no model path: a command without `--model.base.name_or_path` names the flag (exit 2), on any
    machine, before anything else is said or built."""
    from cli import run
    from interleave_model.runtime.machine import NO_MODEL

    assert run([subcommand, "--config", str(config), f"--trainer.default_root_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {NO_MODEL}"]
    assert not any(tmp_path.iterdir())


ARMS = sorted((ROOT / "configs" / "arms").glob("*.yaml"))


def _leaves(tree: dict, path: tuple[str, ...] = ()):
    """(path, value) of every setting a parsed config gives, its groups walked (a list is one value)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def _named(value):
    """A list of classes by their class paths (the parser adds their defaults' `init_args`)."""
    if not isinstance(value, list):
        return value
    return [v["class_path"] if isinstance(v, dict) and "class_path" in v else v for v in value]


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.parametrize("overlay", ARMS, ids=lambda p: p.name)
def test_arm_overlays_parse_on_the_base_they_name(overlay, capsys):
    base = re.search(r"Overlay on (configs/[\w.-]+\.yaml)", overlay.read_text())
    assert base, f"{overlay.name}: its first line names the config it overlays"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(ROOT / base.group(1)), "--config", str(overlay), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    overlaid = yaml.safe_load(overlay.read_text())
    for path, value in _leaves(overlaid):  # the overlay's own values win
        assert _named(_at(printed, path)) == _named(value), f"{overlay.name}: {'.'.join(path)}"
    # the curriculum they make together: per-stage lists as long as the overlay's stages (a fit would refuse them)
    from interleave_data.curriculum import Curriculum
    from interleave_data.curriculum_types import CurriculumSettings
    from interleave_data.length_schedule import AdaptiveLength

    data, settings = printed["data"], dict(printed["data"]["curriculum"])
    settings["adaptive"] = settings["adaptive"] and AdaptiveLength(**settings["adaptive"])
    Curriculum(data["stages"], data["replay_fraction"], CurriculumSettings(**settings), data["sft_steps"])

"""Fixtures shared by every test: offline mode, and a tiny module / datamodule built in a second."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_CONFIG = Path(__file__).parent / "configs" / "tiny.yaml"
TINY_SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
TINY_POSITIONS = "coupled"  # the shipped tiny configs' positions: the tests' subject is the model users run
SET_NUM_THREADS = torch.set_num_threads  # torch's own, taken before any engine can replace it


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and many times faster on a CPU shared with other jobs.

    vLLM's CPU worker replaces `torch.set_num_threads` with a warning for the rest of the process once an engine binds
    its threads, also from a module-scoped fixture set up before this one: torch's own function, taken at import, is
    put back before and after each test, so no test inherits an engine's state."""
    torch.set_num_threads = SET_NUM_THREADS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads = SET_NUM_THREADS
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    """Which copy `merged_copy: auto` takes is whatever a host times fastest; these make any host take each branch, so
    a test that holds on one host holds on all (`pytest --auto-copy prepacked`, `pytest --no-onednn-bf16`)."""
    parser.addoption("--auto-copy", choices=["float32", "bfloat16", "prepacked"], default=None,
                     help="merged_copy: auto takes this copy instead of timing the choices")  # fmt: skip
    parser.addoption("--no-onednn-bf16", action="store_true", help="run as on a CPU whose oneDNN has no bf16 kernels")


@pytest.fixture(autouse=True)
def forced_host(request, monkeypatch):
    """`--auto-copy` and `--no-onednn-bf16` applied in this process (a command a test runs in a subprocess times its
    own choice)."""
    forced, no_bf16 = request.config.getoption("--auto-copy"), request.config.getoption("--no-onednn-bf16")
    if forced is None and not no_bf16:
        return  # the usual run: nothing to patch, and no import of the engines for a test that does not use them
    from interleave_model.generation import merged_copy, sampler
    from interleave_model.runtime import compat, machine

    if forced is not None:

        def fastest_copy(policy, draw, rows, repeats):  # every choice timed as on any host, then the forced one wins
            _, seconds, spread = merged_copy.fastest_copy(policy, draw, rows, repeats)
            chosen = merged_copy.MergedCopy(policy, forced, rows)
            return chosen, seconds | {chosen.dtype: min(seconds.values()) / 2}, spread

        monkeypatch.setattr(sampler, "fastest_copy", fastest_copy)
    if no_bf16:
        for module in (compat, merged_copy):
            monkeypatch.setattr(module, "can_prepack", lambda device: False)
        for module in (compat, machine):
            monkeypatch.setattr(module, "cpu_has_bf16", lambda: False)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """With `-n` (pytest-xdist, `--dist loadgroup`), a test file goes to one worker whole, as its module-scoped
    fixtures expect, unless its tests name finer groups (`xdist_group`). Groups start in order of how many end-to-end
    runs (`slow`) they hold, most first, so the longest work does not start last."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    group = {id(item): item.get_closest_marker("xdist_group").args[0] for item in items}
    slow = Counter(group[id(item)] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[group[id(item)]])


@pytest.fixture
def make_module():
    """Build an `InterleaveGRPO` around a 1-layer, 32-wide tiny Llama; keyword arguments override the defaults.

    Settings are named by their groups, as a config names them: `make(sampling={"temperature": 0.9})` (a dict or the
    group's dataclass); a group's dict is merged into the defaults' (2 samples a group).
    """
    from interleave_model.model.policy import TinyModelConfig
    from interleave_model.module import InterleaveGRPO
    from interleave_model.settings.groups import field_values

    def make(**overrides):
        kwargs = {
            "tiny": TinyModelConfig(**TINY_SHAPE, positions=TINY_POSITIONS),
            "template": "compact",
            "sampling": {"num_generations": 2},
        }
        for name, value in overrides.items():
            default = kwargs.get(name)
            if isinstance(default, dict):  # a group: the defaults' values, then the test's
                value = default | (value if isinstance(value, dict) else field_values(type(value), value))
            kwargs[name] = value
        return InterleaveGRPO(**kwargs)

    return make


@pytest.fixture
def stock_positions(monkeypatch):
    """`make_module` builds the stock Llama (rotary positions 0, 1, 2, ...) instead of the coupled one: for tests of
    free text, or against HF `generate` (coupled positions have their tests in tests/model/model/test_positions.py)."""
    monkeypatch.setattr(sys.modules[__name__], "TINY_POSITIONS", "rope")


@pytest.fixture
def make_datamodule(tmp_path):
    """Build an `InterleaveDataModule` with short stages and few pairs, ready (set up, tokenizer attached)."""
    from interleave_data.datamodule import InterleaveDataModule

    def make(tokenizer, **overrides):
        kwargs = {
            "template": "compact",
            "stages": (4, 8),
            "train_pairs": 40,
            "val_pairs": 4,
            "test_pairs": 4,
            "batch_size": 2,
            "eval_batch_size": 4,
            "cache_dir": str(tmp_path / "cache"),
        }
        dm = InterleaveDataModule(**(kwargs | overrides | {"tokenizer": tokenizer}))
        dm.prepare_data()
        dm.setup("fit")
        return dm

    return make


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    """Model folders following Llama-3, Qwen2 and GPT-2 conventions (tests/families.py), built once per session."""
    from tests.families import FAMILIES, build_family

    root = tmp_path_factory.mktemp("families")
    return {name: build_family(name, root / name) for name in FAMILIES}


@pytest.fixture(params=["llama3", "qwen2", "gpt2"])
def family(request, family_folders) -> tuple[str, Path]:
    """Each real-family model folder in turn: `(name, folder)`."""
    return request.param, family_folders[request.param]


def flat_settings(hparams: dict) -> dict:
    """A checkpoint's grouped hyperparameters written as the code before the groups wrote them (git 35e5889)."""
    from interleave_model.model.migrations import FLAT_NAMES, LOSS_MOVED
    from interleave_model.settings.groups import GROUPS, TERMS

    flat = {key: value for key, value in hparams.items() if key not in GROUPS | TERMS}
    for old, (group, name) in FLAT_NAMES.items():
        if old in LOSS_MOVED:  # an auxiliary term's setting, flat as `loss` held it: its switch, or its value if on
            group, name = LOSS_MOVED[old]
            term = hparams.get(group)  # None too for a group removed since
            if name is None or (old == "guidance" and term is None):
                flat[old] = term is not None if name is None else 0.0
            elif term is not None and name in term:  # a setting removed since has no value to write
                flat[old] = term[name]
        elif name in hparams[group]:  # a setting removed since has no value to write
            flat[old] = hparams[group][name]
    return flat


def fit_one_grpo_step(module, make_datamodule, batch_size: int = 1):
    """One GRPO step of `module` on 3-word pairs, no validation; the trainer (its `callback_metrics`)."""
    import lightning as L

    datamodule = make_datamodule(module.tokenizer, stages=(3,), train_pairs=4, batch_size=batch_size)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    return trainer

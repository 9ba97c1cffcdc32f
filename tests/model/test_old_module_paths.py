"""A checkpoint written while the modules stood flat in interleave_model/ still loads, resumes and names its classes.

`tests/fixtures/old-module-paths.ckpt` was written by commit 0ba8996 (the flat layout) from Python, with its
settings as dataclass objects, so its pickle names `interleave_model.policy.TinyModelConfig`,
`interleave_model.policy.LoraSettings`, `interleave_model.dynamic_sampling.DynamicSampling` and
`interleave_model.vllm_engine.VllmSettings`:

    m = InterleaveGRPO(tiny=TinyModelConfig(hidden_size=8, num_layers=1, num_heads=1, intermediate_size=8),
                       template="compact", lora=LoraSettings(r=2), dynamic_sampling=DynamicSampling(max_rounds=1),
                       vllm=VllmSettings(), optimization={"sft_steps": 1, "learning_rate": 1e-3},
                       sampling={"num_generations": 2})
    dm = InterleaveDataModule(template="compact", stages=(4,), train_pairs=8, val_pairs=2, test_pairs=2,
                              batch_size=2, eval_batch_size=2, sft_steps=1, tokenizer=m.tokenizer, cache_dir=...)
    L.seed_everything(0); Trainer(max_steps=2, ...).fit(m, dm); trainer.save_checkpoint(path)
"""

from __future__ import annotations

import importlib
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch

from interleave_data.datamodule import InterleaveDataModule
from interleave_model.algorithm.dynamic_sampling import DynamicSampling
from interleave_model.config_keys import MovedKeyError, check_moved_keys
from interleave_model.generation.vllm_engine import VllmSettings
from interleave_model.model.policy import LoraSettings, TinyModelConfig
from interleave_model.module import InterleaveGRPO

OLD = Path(__file__).resolve().parent.parent / "fixtures" / "old-module-paths.ckpt"


def test_the_fixture_names_the_old_paths():
    with zipfile.ZipFile(OLD) as archive:
        pickle = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    for old in (b"interleave_model.policy", b"interleave_model.dynamic_sampling", b"interleave_model.vllm_engine"):
        assert old in pickle
    assert b"interleave_model.model" not in pickle


def test_it_loads_with_weights_only():
    hparams = torch.load(OLD, weights_only=True, map_location="cpu")["hyper_parameters"]
    assert isinstance(hparams["lora"], LoraSettings) and hparams["lora"].r == 2
    assert isinstance(hparams["tiny"], TinyModelConfig) and hparams["tiny"].hidden_size == 8
    assert isinstance(hparams["dynamic_sampling"], DynamicSampling) and isinstance(hparams["vllm"], VllmSettings)


def test_load_from_checkpoint_restores_the_weights():
    saved = torch.load(OLD, weights_only=True, map_location="cpu")["state_dict"]
    module = InterleaveGRPO.load_from_checkpoint(OLD, map_location="cpu")
    assert module.dynamic_sampling == DynamicSampling(max_rounds=1)
    state = module.state_dict()
    assert saved.keys() == state.keys() and any("lora_A" in key for key in saved)
    assert all(torch.equal(saved[key], state[key]) for key in saved)


def _datamodule(module: InterleaveGRPO, tmp_path: Path) -> InterleaveDataModule:
    """The data the fixture was fitted on."""
    return InterleaveDataModule(
        template="compact", stages=(4,), train_pairs=8, val_pairs=2, test_pairs=2, batch_size=2, eval_batch_size=2,
        sft_steps=1, tokenizer=module.tokenizer, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip


def test_fit_resumes_from_it(tmp_path):
    module = InterleaveGRPO.load_from_checkpoint(OLD, map_location="cpu")
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, _datamodule(module, tmp_path), ckpt_path=OLD)
    assert trainer.global_step == 3


def test_validate_runs_from_it(tmp_path):
    module = InterleaveGRPO.load_from_checkpoint(OLD, map_location="cpu")
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    (metrics,) = trainer.validate(module, _datamodule(module, tmp_path), ckpt_path=OLD, verbose=False)
    assert "val/alignment_4w" in metrics


def test_old_module_names_are_not_importable():
    """The pickled old paths are mapped where a checkpoint loads (`checkpoint.PICKLED_SETTINGS`), importing nothing."""
    for old in ("interleave_model.callbacks", "interleave_model.vllm_engine", "interleave_model.policy"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "--trainer.callbacks+=interleave_model.callbacks.CurriculumCallback"],
         "interleave_model.callbacks.CurriculumCallback is now interleave_model.run.callbacks.CurriculumCallback"),
        (["fit", "--config", "{config}"],
         "{config}: interleave_model.checkpoint.AtomicCheckpointIO is now "
         "interleave_model.model.checkpoint.AtomicCheckpointIO"),
    ],
)  # fmt: skip
def test_a_config_naming_a_class_by_its_old_path_is_refused_in_one_line_naming_the_new_one(tmp_path, args, message):
    config = tmp_path / "old.yaml"
    config.write_text("trainer:\n  plugins:\n    - class_path: interleave_model.checkpoint.AtomicCheckpointIO\n")
    with pytest.raises(MovedKeyError) as raised:
        check_moved_keys([arg.format(config=config) for arg in args])
    assert str(raised.value) == message.format(config=config)
    check_moved_keys(["fit", "--trainer.callbacks+=interleave_model.run.callbacks.CurriculumCallback"])  # today's


@pytest.mark.parametrize(
    ("cls", "home"),
    [(TinyModelConfig, "model.policy"), (LoraSettings, "model.policy"),
     (DynamicSampling, "algorithm.dynamic_sampling"), (VllmSettings, "generation.vllm_engine"),
     (TinyModelConfig, "settings"), (LoraSettings, "settings"), (DynamicSampling, "settings"),
     (VllmSettings, "settings")],
)  # fmt: skip
def test_settings_pickled_where_they_stood_before_load_with_weights_only(cls, home, tmp_path, monkeypatch):
    """These classes stood in their readers once, then all in one `settings.py`; checkpoints name them there."""
    import interleave_model.module  # noqa: F401  (registers the settings as safe globals)

    path = tmp_path / "settings.pt"
    with monkeypatch.context() as patch:
        patch.setattr(cls, "__module__", f"interleave_model.{home}")  # pickled by the name it had there
        patch.setattr(importlib.import_module(f"interleave_model.{home}"), cls.__name__, cls, raising=False)
        torch.save({"settings": cls()}, path)
    assert f"interleave_model.{home}".encode() in zipfile.ZipFile(path).read("settings/data.pkl")
    assert torch.load(path, weights_only=True)["settings"] == cls()

"""LoRA on a base from disk: checkpoints hold the adapter, not the frozen base, and every way of loading them works."""

import warnings

import lightning as L
import pytest
import torch

from interleave_model.model.checkpoint import BASE_OMITTED
from interleave_model.model.export import export, load_weights
from interleave_model.model.policy import LoraSettings, PolicyError
from interleave_model.module import InterleaveGRPO

LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


def _trainer(root, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", max_steps=steps, default_root_dir=root, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip


@pytest.fixture
def lora_run(make_module, make_datamodule, tmp_path):
    """Two warm-start steps and one GRPO step of LoRA on a tiny base saved to disk; the module and its checkpoint."""
    base = export(make_module(), tmp_path / "base")
    make = lambda init_from=None: make_module(base={"name_or_path": str(base), "init_from": init_from}, lora=LORA)  # noqa: E731
    module = make()
    trainer = _trainer(tmp_path, steps=3)
    trainer.fit(module, datamodule=make_datamodule(module.tokenizer, sft_steps=2))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return module, path, make, make_datamodule


def test_the_checkpoint_holds_the_adapter_and_not_the_base(lora_run):
    module, path, _, _ = lora_run
    checkpoint = torch.load(path, weights_only=False)

    policy_keys = [k for k in checkpoint["state_dict"] if k.startswith("policy.")]
    trainable = {"policy." + n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert set(policy_keys) == trainable and all("lora_" in k for k in policy_keys)
    assert checkpoint[BASE_OMITTED] == module.base.name_or_path
    kept = sum(checkpoint["state_dict"][k].numel() for k in policy_keys)
    assert kept < 0.05 * sum(v.numel() for v in module.state_dict().values())


def test_it_loads_back_into_the_same_weights_by_every_route(lora_run, tmp_path):
    module, path, make, make_datamodule = lora_run
    trained = {k: v.clone() for k, v in module.state_dict().items()}
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in trained.items() if "lora_B" in k)  # it trained

    exported = make()
    load_weights(exported, path)  # cli.py export / validate route
    initialised = make(init_from=str(path))  # --model.base.init_from route
    for other in (exported, initialised):
        for key, value in other.state_dict().items():
            torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the base's weights, left out by design, are no warning
        loaded = InterleaveGRPO.load_from_checkpoint(path)  # the benchmarks' route
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)

    resumed = make()  # fit --ckpt_path route: Lightning restores with the module's strict_loading
    trainer = _trainer(tmp_path, steps=4)
    trainer.fit(resumed, datamodule=make_datamodule(resumed.tokenizer, sft_steps=2), ckpt_path=path)
    assert trainer.global_step == 4


def test_a_checkpoint_missing_adapter_weights_is_refused(lora_run, tmp_path):
    _, path, make, _ = lora_run
    checkpoint = torch.load(path, weights_only=False)
    dropped = next(k for k in checkpoint["state_dict"] if "lora_A" in k)
    del checkpoint["state_dict"][dropped]
    broken = tmp_path / "broken.ckpt"
    torch.save(checkpoint, broken)

    with pytest.raises(PolicyError, match="missing"):
        load_weights(make(), broken)
    with pytest.raises(PolicyError, match="model.base.init_from: .*missing"):
        make(init_from=str(broken))

"""Export: the folder loads with `from_pretrained` and gives the module's log-probs, with and without LoRA."""

import json

import pytest
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer

from interleave_data.atomic import replacing_dir
from interleave_model.algorithm.completions import completion_logits
from interleave_model.algorithm.logprobs import token_logprobs
from interleave_model.model.export import BASE_MODEL_DIR, export, load_weights
from interleave_model.model.policy import LoraSettings, PolicyError

TEXTS = ["A: the first\nB: a second\nInterleave: the a first second", "A: one\nB: two\nInterleave: one two"]


# TEXTS are whole sequences scored from their first token, numbered 0, 1, 2, ...: the stock Llama
pytestmark = pytest.mark.usefixtures("stock_positions")


def _logprobs(model, tokenizer) -> torch.Tensor:
    """Log-probs of every token after the first, as the module computes them for the loss. [B, L-1]"""
    encoded = tokenizer(TEXTS, padding=True, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]  # [B, L] left-padded
    with torch.no_grad():
        logits = completion_logits(model.eval(), ids, mask, width=ids.shape[1] - 1)  # [B, L-1, V]
        return token_logprobs(logits, ids[:, 1:], temperature=1.0) * mask[:, 1:]


def _check_tokenizer(module, out):
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(TEXTS)["input_ids"] == module.tokenizer(TEXTS)["input_ids"]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        module.tokenizer.eos_token_id,
        module.tokenizer.pad_token_id,
    )
    assert tokenizer.padding_side == "left"
    return tokenizer


def test_full_model_export(make_module, tmp_path):
    module = make_module()
    expected = _logprobs(module.policy, module.tokenizer)

    out = export(module, tmp_path / "model", source={"checkpoint": "x.ckpt", "global_step": 7})
    tokenizer = _check_tokenizer(module, out)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logprobs(loaded, tokenizer), expected, rtol=0, atol=1e-6)
    info = json.loads((out / "export.json").read_text())
    assert info == {"model_name_or_path": "tiny", "lora": False, "checkpoint": "x.ckpt", "global_step": 7}


def _lora_module(make_module, **overrides):
    module = make_module(lora=LoraSettings(r=4, alpha=8, dropout=0.0), **overrides)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a fresh adapter is the identity (B = 0); give it weights so that it matters
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return module


def test_lora_adapter_export_of_the_tiny_model(make_module, tmp_path):
    module = _lora_module(make_module)
    expected = _logprobs(module.policy, module.tokenizer)
    with module.policy.disable_adapter():
        assert not torch.allclose(_logprobs(module.policy, module.tokenizer), expected, atol=1e-3)

    out = export(module, tmp_path / "adapter")
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    # the tiny base exists only in memory, so it is saved beside the adapter, which names it
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(out / BASE_MODEL_DIR)
    tokenizer = _check_tokenizer(module, out)
    loaded = AutoPeftModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logprobs(loaded, tokenizer), expected, rtol=0, atol=1e-6)

    merged = export(module, tmp_path / "merged", merge_lora=True)
    assert not (merged / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(merged)
    torch.testing.assert_close(_logprobs(loaded, tokenizer), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logprobs(module.policy, module.tokenizer), expected)  # the module is untouched


def test_lora_adapter_of_a_local_model_names_its_folder(make_module, tmp_path):
    base = make_module()
    export(base, tmp_path / "base")
    module = _lora_module(make_module, base={"name_or_path": str(tmp_path / "base")})

    out = export(module, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    assert not (out / BASE_MODEL_DIR).exists()
    loaded = AutoPeftModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logprobs(loaded, module.tokenizer), _logprobs(module.policy, module.tokenizer))


def test_lora_adapter_of_a_relative_model_path_names_it_absolute(make_module, tmp_path, monkeypatch):
    export(make_module(), tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    module = _lora_module(make_module, base={"name_or_path": "./base"})

    out = export(module, tmp_path / "adapter")
    monkeypatch.chdir(out)  # where "./base" names nothing
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    AutoPeftModelForCausalLM.from_pretrained(out)


def test_export_replaces_an_earlier_export_whole_and_never_a_folder_of_other_files(make_module, tmp_path):
    module = make_module()
    out = export(module, tmp_path / "model", source={"global_step": 1})
    (out / "stale.txt").write_text("from an older export")
    export(module, out, source={"global_step": 2})
    assert json.loads((out / "export.json").read_text())["global_step"] == 2
    assert not (out / "stale.txt").exists()  # swapped in whole, not written over file by file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folders left beside it

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own")
    with pytest.raises(FileExistsError, match="mine: exists and is not a folder this writes"):
        export(module, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_failed_export_leaves_the_earlier_one_as_it_was(make_module, tmp_path, monkeypatch):
    module = make_module()
    out = export(module, tmp_path / "model", source={"global_step": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module.tokenizer, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        export(module, out, source={"global_step": 2})
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_swap_killed_between_its_renames_is_undone_by_the_next_write(tmp_path):
    # what a kill right after `path -> .path.old` leaves: no `path`, the whole old folder, a finished new one
    old, tmp = tmp_path / ".out.old", tmp_path / ".out.tmp"
    old.mkdir()
    (old / "export.json").write_text("old")
    tmp.mkdir()
    (tmp / "export.json").write_text("new, never swapped in")
    with pytest.raises(RuntimeError), replacing_dir(tmp_path / "out", lambda p: True):
        raise RuntimeError("failed while writing")
    assert (tmp_path / "out" / "export.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_checkpoint_that_does_not_fit_is_refused_alike_by_export_and_init_from(make_module, tmp_path):
    weights = {f"policy.{k}": v for k, v in make_module().policy.state_dict().items()}
    dropped = next(k for k in weights if "q_proj" in k)
    torch.save({"state_dict": {k: v for k, v in weights.items() if k != dropped}}, tmp_path / "a.ckpt")

    with pytest.raises(PolicyError, match=r"(?s)a\.ckpt: weights do not fit this model: .*Missing key"):
        load_weights(make_module(), tmp_path / "a.ckpt")
    with pytest.raises(
        PolicyError, match=r"(?s)model.base.init_from: .*a\.ckpt: weights do not fit this model: .*Missing key"
    ):
        make_module(base={"init_from": str(tmp_path / "a.ckpt")})

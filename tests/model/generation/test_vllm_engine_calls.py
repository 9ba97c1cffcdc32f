"""What the vLLM engine asks of vLLM and of torch, in order, with a stand-in for vLLM's `LLM`: waking from sleep mode,
autocast, per-request seeds and the distributed environment. The real engine's tokens: test_vllm_engine.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from interleave_model.generation import vllm_engine
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.generation.vllm_engine import VllmEngine, VllmSettings, launcher_environment


class StandInLLM:
    """Records every call the engine makes, in order, and answers `generate` with one token per completion."""

    def __init__(self, calls: list):
        self.calls = calls

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        self.calls.append(("generate", torch.is_autocast_enabled("cpu"), [p["seed"] for p in params]))
        row = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}])
        return [SimpleNamespace(outputs=[row] * p["n"]) for p in params]


@pytest.fixture
def engine(monkeypatch) -> tuple[VllmEngine, list]:
    """An engine around the stand-in, sleep mode on, serving full weights; `calls` records torch's cache release."""
    calls: list = []
    engine = object.__new__(VllmEngine)
    engine.llm, engine._vllm = StandInLLM(calls), SimpleNamespace(SamplingParams=lambda **kw: kw)
    engine.settings, engine.sleep_mode, engine._asleep = VllmSettings(enable_sleep_mode=True), True, False
    engine.lora, engine.version, engine._lora_request = False, None, None
    engine.tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids, **kw: " ".join(map(str, ids)))
    monkeypatch.setattr(engine, "_push_weights", lambda policy: calls.append(("push_weights",)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(vllm_engine, "no_autocast", lambda: torch.autocast("cpu", enabled=False))  # no CUDA here
    monkeypatch.setattr(vllm_engine, "completion_texts", lambda tokenizer, ids, stops: ["7"] * len(ids))
    return engine, calls


def test_a_sleeping_engine_wakes_its_weights_takes_the_new_ones_then_its_kv_cache_each_after_a_cache_release(engine):
    engine, calls = engine
    engine.sleep()
    engine.serve(policy=None, version=1)
    assert calls == [
        ("sleep", 1),
        ("empty_cache",), ("wake_up", ["weights"]),  # the update's cached blocks go back before the engine's return
        ("push_weights",),
        ("empty_cache",), ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]  # fmt: skip
    calls.clear()
    engine.serve(policy=None, version=1)  # the same weights: nothing to do
    assert calls == []


def _rollout(engine: VllmEngine, temperature: float = 1.0):
    ids, mask = torch.tensor([[5, 6], [0, 6]]), torch.tensor([[1, 1], [0, 1]])
    params = SamplingParams(num_generations=2, max_new_tokens=4, stop_ids=[2], temperature=temperature)
    return engine.rollout(ids, mask, params, torch.Generator().manual_seed(0))


def test_the_engine_samples_outside_the_trainers_autocast(engine):
    engine, calls = engine
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as Lightning's bf16-mixed runs training_step
        _rollout(engine)
    (autocast_on, _), *_ = [call[1:] for call in calls if call[0] == "generate"]
    assert autocast_on is False


def test_requests_carry_seeds_only_when_asked(engine):
    engine, calls = engine
    _rollout(engine)
    assert calls[-1][2] == [None, None]  # the engine's own stream: vLLM samples the batch together
    engine.settings = VllmSettings(seed_each_request=True)
    _rollout(engine)
    seeds = calls[-1][2]
    assert len(set(seeds)) == 2 and None not in seeds  # one per prompt, drawn from the generator
    _rollout(engine)
    assert calls[-1][2] == seeds  # the generator's state decides them


def test_the_launcher_environment_is_the_process_groups(tmp_path, monkeypatch):
    """vLLM's external launcher reads torchrun's variables, which Lightning's own launcher does not all set."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ours = not torch.distributed.is_initialized()  # a vLLM engine of another test may hold this worker's group of one
    if ours:
        store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert launcher_environment() == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        monkeypatch.setenv("LOCAL_RANK", "3")  # set by a launcher that knows: kept
        assert launcher_environment()["LOCAL_RANK"] == "3"
    finally:
        if ours:
            torch.distributed.destroy_process_group()
    assert "RANK" not in os.environ  # read, not written: the engine writes it where it uses it


def test_the_folder_written_for_the_engine_is_the_plain_base_under_lora(family_folders, tmp_path):
    """The tiny model has no folder: the engine loads the one `save_base` writes. Under LoRA it must hold the base's
    weights under plain names (vLLM knows no `base_layer`) and none of the adapter's."""
    from safetensors.torch import load_file

    from interleave_model.generation.vllm_engine import save_base
    from interleave_model.model.policy import LoraSettings, apply_lora, load_pretrained

    model, tokenizer = load_pretrained(str(family_folders["llama3"]), dtype="float32")
    plain = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    save_base(apply_lora(model, LoraSettings(r=2, dropout=0.0)), tokenizer, str(tmp_path))
    saved = {}
    for shard in tmp_path.glob("*.safetensors"):
        saved |= load_file(shard)
    assert not [name for name in saved if "lora_" in name or "base_layer" in name]
    assert saved.keys() <= plain.keys() and {n for n in plain if "embed" in n or "proj" in n} <= saved.keys()
    assert all(torch.equal(saved[name], plain[name]) for name in saved)
    reloaded, _ = load_pretrained(str(tmp_path), dtype="float32")  # from_pretrained takes it as it is
    assert all(torch.equal(t, plain[n]) for n, t in reloaded.state_dict().items())


@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_vllm_samples_without_speculation_and_says_so_once(monkeypatch, capsys, draft_tokens):
    from interleave_model.generation import sampler
    from interleave_model.settings.sampling import Sampling

    built = []
    monkeypatch.setattr(sampler, "VllmEngine", lambda *args, **kwargs: built.append(kwargs) or SimpleNamespace(
        serve=lambda policy, version: None))  # fmt: skip
    own = sampler.Sampler(torch.nn.Linear(1, 1), None, [2], engine="vllm",
                          sampling=Sampling(speculative_tokens=draft_tokens))  # fmt: skip
    for version in range(3):
        own._vllm_engine(version, rank=0)
    lines = capsys.readouterr().err.splitlines()
    assert len(built) == 1
    assert lines == ([f"warning: {sampler.VLLM_SPECULATION}"] if draft_tokens else [])

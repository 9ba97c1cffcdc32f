"""What a machine cannot honour is refused in one line before anything is built, or turned off with one warning."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from jsonargparse import Namespace

from interleave_model.generation.vllm_engine import VllmSettings
from interleave_model.runtime import machine
from interleave_model.runtime.machine import MachineError, engine_settings, settle

CPU = SimpleNamespace(device_type="cpu", is_sleep_mode_available=lambda: False, is_cuda_alike=lambda: False)
CUDA = SimpleNamespace(device_type="cuda", is_sleep_mode_available=lambda: True, is_cuda_alike=lambda: True)
GPU_SETTINGS = VllmSettings(max_model_len=4096, enforce_eager=False, enable_sleep_mode=True)  # configs/llama-3.2-3b


def _config(accelerator="cpu", precision=None, rollout_engine="own", strategy="auto", model="tiny") -> Namespace:
    return Namespace(trainer=Namespace(accelerator=accelerator, precision=precision, strategy=strategy),
                     model=Namespace(rollout_engine=rollout_engine, base=Namespace(name_or_path=model)))  # fmt: skip


def _warnings(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.fixture
def no_vllm(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))


@pytest.mark.parametrize("accelerator", ["gpu", "cpu"])
def test_no_model_named_is_refused_first_with_the_flag_to_pass(accelerator, no_gpu):
    with pytest.raises(MachineError, match="^model.base.name_or_path is not set: pass --model.base.name_or_path"):
        settle(_config(accelerator, model=None), "fit")  # before the GPU's absence is mentioned


@pytest.mark.parametrize("strategy", ["fsdp", Namespace(class_path="lightning.pytorch.strategies.FSDPStrategy")])
def test_fsdp_with_the_vllm_engine_is_refused_with_what_to_change(strategy):
    with pytest.raises(MachineError, match="cannot be handed: run FSDP with --model.rollout_engine own"):
        settle(_config(rollout_engine="vllm", strategy=strategy), "fit")
    settle(_config(rollout_engine="own", strategy=strategy), "fit")  # FSDP with the own sampler runs


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_accelerator_without_a_gpu_is_refused_with_what_to_change(accelerator, no_gpu):
    with pytest.raises(MachineError, match=f"trainer.accelerator is '{accelerator}'.*--trainer.accelerator cpu"):
        settle(_config(accelerator), "fit")


def test_a_driver_too_old_for_torchs_cuda_is_named_not_taken_for_no_gpu(tmp_path, monkeypatch):
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    reason = machine.no_gpu_reason(str(driver))

    assert reason.startswith(f"torch {torch.__version__}, built for CUDA 13.0, cannot use this machine's NVIDIA driver")
    assert "driver 535.104.05: install a torch built for a CUDA version this driver supports" in reason
    driver.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs)\n")
    assert "NVIDIA driver 570.86.15: install" in machine.no_gpu_reason(str(driver))  # the open module's wording
    assert (
        machine.no_gpu_reason(str(tmp_path / "none")) == "this machine has no GPU: run with --trainer.accelerator cpu"
    )


@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
def test_bf16_on_a_cpu_without_bf16_runs_32_true_with_one_warning(accelerator, no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: False)
    config = _config(accelerator, "bf16-mixed")
    settle(config, "fit")
    assert config.trainer.precision == "32-true"
    (line,) = _warnings(capsys)
    assert line.startswith("warning: trainer.precision: bf16-mixed")


def test_bf16_on_a_cpu_with_bf16_is_kept(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: True)
    config = _config("cpu", "bf16-mixed")
    settle(config, "fit")
    assert config.trainer.precision == "bf16-mixed" and not _warnings(capsys)


@pytest.mark.parametrize("choice", ["bfloat16", "auto"])
@pytest.mark.parametrize("has_bf16", [False, True])
def test_a_bf16_merged_copy_on_a_cpu_without_bf16_is_float32_with_one_warning(
    has_bf16, choice, no_gpu, monkeypatch, capsys
):
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: has_bf16)
    config = _config("cpu", "32-true")
    config.model.sampling = Namespace(merged_copy=choice)
    settle(config, "fit")
    assert config.model.sampling.merged_copy == (choice if has_bf16 else "float32")
    lines = _warnings(capsys)
    assert lines == [] if has_bf16 else lines[0].startswith(f"warning: model.sampling.merged_copy: {choice} would")


def test_a_merged_copy_under_fsdp_is_refused_with_what_to_change():
    config = _config(strategy="fsdp")
    config.model.sampling = Namespace(merged_copy="float32")
    with pytest.raises(MachineError, match="cannot merge: run FSDP with --model.sampling.merged_copy null"):
        settle(config, "fit")


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_the_vllm_engine_without_vllm_is_refused_with_what_to_change(subcommand, no_vllm):
    with pytest.raises(MachineError, match="vLLM is not installed.*--model.rollout_engine own"):
        settle(_config(rollout_engine="vllm"), subcommand)


def test_check_without_vllm_answers_with_the_own_sampler_and_says_so(no_vllm, capsys):
    config = _config(rollout_engine="vllm")
    settle(config, "check")
    assert config.model.rollout_engine == "own"
    (line,) = _warnings(capsys)
    assert line.startswith("warning: model.rollout_engine:")


def test_on_a_cpu_the_engine_runs_awake_within_the_models_positions_and_says_it_has_no_cuda_graphs(capsys):
    settings = engine_settings(GPU_SETTINGS, CPU, max_positions=2048)
    # enforce_eager stays: vLLM leaves CUDA graphs out on a CPU itself and keeps torch.compile
    assert (settings.enable_sleep_mode, settings.enforce_eager, settings.max_model_len) == (False, False, 2048)
    lines = _warnings(capsys)
    options = ("model.vllm.enable_sleep_mode", "model.vllm.enforce_eager", "model.vllm.max_model_len")
    assert len(lines) == 3 and all(line.startswith(f"warning: {o}:") for line, o in zip(lines, options, strict=True))


def test_on_a_gpu_the_engine_keeps_every_option(capsys):
    assert engine_settings(GPU_SETTINGS, CUDA, max_positions=131072) == GPU_SETTINGS
    assert engine_settings(GPU_SETTINGS, CUDA, max_positions=None) == GPU_SETTINGS
    assert not _warnings(capsys)


GIB = 2**30


def test_on_a_cpu_a_memory_share_more_than_is_free_gives_the_kv_cache_half_of_what_is_free(capsys):
    # vLLM's CPU worker refuses to start when gpu_memory_utilization x the machine's memory is more than is free
    settings = engine_settings(
        VllmSettings(gpu_memory_utilization=0.3, enforce_eager=True), CPU, None, memory=(20 * GIB, 5 * GIB)
    )
    assert settings.kv_cache_memory_bytes == 5 * GIB // 2
    (line,) = _warnings(capsys)
    assert line.startswith("warning: model.vllm.gpu_memory_utilization: 0.3") and "kv_cache_memory_bytes" in line


def test_on_a_cpu_a_memory_share_that_fits_is_the_kv_cache_and_an_exact_kv_cache_is_kept(capsys):
    # vLLM would give the KV cache the share less the process's resident memory: in a trainer, little or nothing
    fits = VllmSettings(gpu_memory_utilization=0.2, enforce_eager=True)
    assert engine_settings(fits, CPU, None, memory=(20 * GIB, 5 * GIB)).kv_cache_memory_bytes == 4 * GIB
    exact = VllmSettings(gpu_memory_utilization=0.9, kv_cache_memory_bytes=GIB, enforce_eager=True)
    assert engine_settings(exact, CPU, None, memory=(20 * GIB, 5 * GIB)) == exact
    assert not _warnings(capsys)


def test_cpu_memory_reads_a_total_and_a_free_size_of_this_machine():
    pytest.importorskip("vllm")
    total, free = machine.cpu_memory()
    assert 0 < free <= total

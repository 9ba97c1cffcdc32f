"""What this machine can honour of a run's options, settled in one place.

A config written for GPUs (`configs/llama-3.2-3b.yaml`: a GPU, bf16, vLLM with sleep mode and CUDA graphs) must still
`check` a model on a CPU, and any command must end in one line that says what to change, not deep inside an engine.
An option the run can do without is turned off with one `warning:` line naming it; one it cannot do without is
refused with a `MachineError`, which the CLI prints as one `error:` line (exit 2).

`settle` fits a command's parsed config before anything is built; `settle_engine` asks, once the model is built and
before the command runs, whether vLLM here can serve it; `engine_settings` fits the vLLM engine's options to the
platform vLLM runs on and to the model it loads, as the engine starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_only

from interleave_model.runtime.compat import cpu_has_bf16

GPU_ACCELERATORS = ("gpu", "cuda")


NO_MODEL = (
    "model.base.name_or_path is not set: pass --model.base.name_or_path with your model's folder "
    "(e.g. /models/Llama-3.2-3B-Instruct) or a hub name"
)


class MachineError(ValueError):
    """An option this machine cannot honour, with what to change; the CLI prints it as one `error:` line."""


@rank_zero_only
def warn(line: str) -> None:
    """One `warning:` line on stderr, from rank 0 only (every rank settles the same config)."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def settle(config, subcommand: str) -> None:
    """Fit a command's parsed config (`trainer`, `model`) to this machine, in place.

    Refused: no model named (`model.base.name_or_path: null`, as the 3B configs ship); a GPU accelerator without a
    GPU; `model.rollout_engine: vllm` or `model.sampling.merged_copy` under FSDP (both take whole weights);
    `model.rollout_engine: vllm` without vLLM installed, except in `check`, which then answers with the own sampler.
    Turned off: bf16 precision on a CPU without bf16 instructions; a bfloat16 merged copy there is made float32.
    """
    trainer, model = config.trainer, config.model
    if model.base.name_or_path is None:  # a config that names no model (the 3B ones) makes the user name theirs
        raise MachineError(NO_MODEL)
    accelerator = trainer.accelerator if isinstance(trainer.accelerator, str) else None
    cuda = torch.cuda.is_available()
    if accelerator in GPU_ACCELERATORS and not cuda:
        raise MachineError(f"trainer.accelerator is {accelerator!r}, but {no_gpu_reason()}")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not cuda and not torch.backends.mps.is_available())
    precision = str(trainer.precision)
    if on_cpu and precision.startswith("bf16") and not cpu_has_bf16():
        warn(f"trainer.precision: {precision} needs a CPU with bf16 instructions (AVX512-BF16 or AMX); "
             "this one has none, so the run uses 32-true")  # fmt: skip
        trainer.precision = "32-true"
    sampling = getattr(model, "sampling", None)
    if on_cpu and getattr(sampling, "merged_copy", None) in ("bfloat16", "prepacked", "auto") and not cpu_has_bf16():
        warn(f"model.sampling.merged_copy: {sampling.merged_copy} would try bfloat16, which needs a CPU with bf16 "
             "instructions (AVX512-BF16 or AMX); this one has none, so the copy is float32")  # fmt: skip
        sampling.merged_copy = "float32"
    strategy = trainer.strategy if isinstance(trainer.strategy, str) else getattr(trainer.strategy, "class_path", "")
    sharded = "fsdp" in str(strategy).lower()
    if getattr(sampling, "merged_copy", None) and sharded:
        raise MachineError(
            f"trainer.strategy {strategy!r} shards the weights, which model.sampling.merged_copy cannot merge: "
            "run FSDP with --model.sampling.merged_copy null"
        )
    if model.rollout_engine == "vllm" and sharded:
        raise MachineError(
            f"trainer.strategy {strategy!r} shards the weights, which the colocated vLLM engine cannot be handed: "
            "run FSDP with --model.rollout_engine own, or vLLM with --trainer.strategy ddp"
        )
    if model.rollout_engine == "vllm" and importlib.util.find_spec("vllm") is None:
        if subcommand != "check":
            raise MachineError(
                "model.rollout_engine is 'vllm', but vLLM is not installed: `pip install -e \".[vllm]\"` on a GPU "
                "machine, or run with --model.rollout_engine own"
            )
        warn("model.rollout_engine: vLLM is not installed, so check answers with the own sampler")
        model.rollout_engine = "own"


def settle_engine(module, subcommand: str) -> None:
    """With `model.rollout_engine: vllm`, a built model vLLM cannot serve on this machine (`engine_problem`) is
    refused, before any step (a fit would otherwise fail at its first rollout, after the warm-start); `check` answers
    with the own sampler instead, with one warning line. The same rule as for vLLM not installed (`settle`): a check
    is asked about the model, a run asked for the engine."""
    if subcommand == "export" or module.sampler.kind != "vllm":
        return
    problem = engine_problem(module.policy.config)
    if problem is None:
        return
    if subcommand != "check":
        raise MachineError(f"model.rollout_engine is 'vllm', but {problem}: run with --model.rollout_engine own")
    warn(f"model.rollout_engine: {problem}, so check answers with the own sampler")
    module.sampler.kind = "own"


def engine_problem(config) -> str | None:
    """Why vLLM here cannot serve a model of this (transformers) `config`, or None when nothing known stops it.

    vLLM's CPU attention declares the head sizes its kernels run (32, 64, 80, ...) but does not check them as it
    starts: a model of another head size fails at its first forward pass, deep in a kernel (`RuntimeError:
    Unsupported CPU attention configuration`). On a GPU vLLM chooses its attention backend by head size and refuses,
    as it starts, a size none of them runs. Models with latent attention (MLA) run other CPU backends.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(config, "kv_lora_rank", None):
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    heads = getattr(config, "num_attention_heads", None)
    size = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if size is None or CPUAttentionBackend.supports_head_size(size):
        return None
    sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
    return f"vLLM's CPU attention runs heads of {sizes} dimensions, and this model's have {size}"


def engine_settings(settings, platform, max_positions: int | None, memory: tuple[int, int] | None = None):
    """The vLLM settings the engine can honour on `platform` (vLLM's `current_platform`) for a model of
    `max_positions` positions (None: no limit known) on a CPU whose memory node holds `memory` = (total, free) bytes
    (`cpu_memory`; None on a GPU); each option it changes or vLLM cannot serve is one warning line.

    Sleep mode is off where the platform has none (a CPU), which vLLM would refuse, and `max_model_len` is cut to the
    model's positions, which vLLM would refuse too. On a CPU, vLLM reads `gpu_memory_utilization` as a share of the
    machine's memory and gives the KV cache that share less the resident memory of the whole process: in a training
    process, which holds the trainer, its data and an earlier engine's leftovers, that is little or nothing, and vLLM
    refuses to start. So on a CPU the KV cache is sized here: the share of the machine, or half of what is free when
    the share is more than is free (beside other runs). CUDA graphs (`enforce_eager: false`) vLLM leaves out itself
    where there is no CUDA: that is said, and the option stays, since it also keeps vLLM's torch.compile, which
    decodes faster on a CPU too.
    """
    changes = {}
    if settings.enable_sleep_mode and not platform.is_sleep_mode_available():
        warn(f"model.vllm.enable_sleep_mode: vLLM has no sleep mode on {platform.device_type}; the engine stays awake")
        changes["enable_sleep_mode"] = False
    if not settings.enforce_eager and not platform.is_cuda_alike():
        warn(f"model.vllm.enforce_eager: false asks for CUDA graphs, which need CUDA; on {platform.device_type} vLLM "
             "runs without them")  # fmt: skip
    if max_positions is not None and settings.max_model_len is not None and settings.max_model_len > max_positions:
        warn(f"model.vllm.max_model_len: {settings.max_model_len} is more than the model's {max_positions} "
             f"positions; the engine uses {max_positions}")  # fmt: skip
        changes["max_model_len"] = max_positions
    if memory is not None and settings.kv_cache_memory_bytes is None:
        total, free = memory
        share = settings.gpu_memory_utilization
        wanted = math.ceil(total * share)
        changes["kv_cache_memory_bytes"] = wanted if wanted <= free else free // 2
        if wanted > free:
            warn(f"model.vllm.gpu_memory_utilization: {share} of this machine's memory ({_gib(total * share)} GiB) "
                 f"is more than the {_gib(free)} GiB free, so the engine's KV cache takes {_gib(free // 2)} GiB; "
                 "set model.vllm.kv_cache_memory_bytes to choose")  # fmt: skip
    return dataclasses.replace(settings, **changes)


def cpu_memory() -> tuple[int, int]:
    """Total and free bytes of the memory node vLLM's CPU engine allocates from, as vLLM reads them."""
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    node = get_memory_node_info(0)
    return node.total_memory, node.available_memory


def _gib(size: float) -> str:
    return f"{size / 2**30:.1f}"


def no_gpu_reason(driver_file: str = "/proc/driver/nvidia/version") -> str:
    """Why torch sees no GPU, and what to do: no NVIDIA driver at all, or one too old for this torch's CUDA build
    (PyPI's Linux torch wheels are built for a recent CUDA, which needs a recent driver)."""
    try:
        text = Path(driver_file).read_text()
    except OSError:
        return "this machine has no GPU: run with --trainer.accelerator cpu"
    # "... Kernel Module  535.104.05  ..." or the open module's "... Open Kernel Module for x86_64  570.86.15  ..."
    found = re.search(r"Kernel Module.*?\b(\d+\.\d+(?:\.\d+)?)\b", text)
    driver = found.group(1) if found else "(version unread)"
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    return (
        f"torch {torch.__version__}, {built}, cannot use this machine's NVIDIA driver {driver}: "
        "install a torch built for a CUDA version this driver supports (nvidia-smi names the highest), or update the "
        "driver"
    )

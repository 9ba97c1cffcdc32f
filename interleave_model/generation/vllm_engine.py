"""Rollouts on vLLM, colocated in the training process and handed the policy's new weights after every update."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers.utils import logging as hf_logging

from interleave_model.generation.rollout import Rollout, completion_texts
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.policy import is_peft
from interleave_model.runtime.compat import shutdown_vllm
from interleave_model.runtime.machine import cpu_memory, engine_settings
from interleave_model.settings.sampling import VllmSettings

# Inside a training process the engine core must run in this process: the default spawns a worker that would load
# the model a second time and could not see the trainer's weights.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Its start-up report (dozens of INFO and WARNING lines per engine, none for the user to act on) would bury the
# training log: errors only, on stderr with the other libraries' messages. vLLM configures its logger from these two
# variables as each engine starts; what it says before that (at import) passes the "vllm" logger's own level.
# LOGLEVEL (interleave_model.run.console), or the variables, bring the rest back.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())


# the engines alive in this process, for `close_engines`
ENGINES: weakref.WeakSet[VllmEngine] = weakref.WeakSet()


def close_engines() -> None:
    """Shut down every engine of this process. A DDP run calls it after training, while the process group still
    stands: left to the interpreter's exit, an engine's shutdown would tear down groups already gone (a traceback per
    rank after a finished run)."""
    for engine in list(ENGINES):
        engine.close()


def save_base(policy: torch.nn.Module, tokenizer, folder: str) -> None:
    """Write `policy`'s base model as a plain `from_pretrained` folder for the engine to load. Under LoRA the base's
    layers are peft's wrappers: their weights are saved under the plain names (`q_proj.weight`, not
    `q_proj.base_layer.weight`) and the adapter's are left out (the engine is served the adapter apart)."""
    base = policy.get_base_model() if is_peft(policy) else policy
    state = {name.replace(".base_layer.", "."): tensor for name, tensor in base.state_dict().items()
             if ".lora_" not in name}  # fmt: skip
    base.save_pretrained(folder, state_dict=state)
    tokenizer.save_pretrained(folder)


def no_autocast() -> torch.autocast:
    """Autocast off on this machine's device type: Lightning's mixed precision must not reach into the engine's
    forward passes (their dtype is the engine's own)."""
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", enabled=False)


def launcher_environment() -> dict[str, str]:
    """This process's place in the training's process group, as vLLM's `external_launcher` reads it (`RANK`,
    `LOCAL_RANK`, `WORLD_SIZE`: torchrun's variables). Lightning's own launcher and its SLURM environment do not
    export them all, so they are written from the group itself (as TRL does); a `LOCAL_RANK` already set is kept, else
    the process's CUDA device, else (on a CPU, one machine) the rank."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local = os.environ.get("LOCAL_RANK") or str(torch.cuda.current_device() if torch.cuda.is_available() else rank)
    return {"RANK": str(rank), "LOCAL_RANK": local, "WORLD_SIZE": str(world)}


class VllmEngine:
    """A vLLM engine holding a copy of the policy, sampling groups of completions into the sampler's `Rollout`.

    The engine starts from the policy's model folder (the tiny model is written to a temporary one). Under LoRA it
    serves the trainer's adapter, saved after every update and loaded under a fresh id; the base is never merged, so
    the trainer's frozen weights stay bitwise as loaded. Without LoRA every weight is pushed into the engine's model.
    Under DDP each rank holds its own engine (`external_launcher`).

    Args:
        policy: The trainer's policy (a transformers causal LM, maybe wrapped by peft).
        tokenizer: Its tokenizer; decodes the completions and pads them.
        model_path: The folder (or hub name) the policy was loaded from; None writes the policy's base to a folder.
        settings: The engine's options.
        seed: Seed of the engine's own sampling stream (with `seed_each_request`, rollouts given a generator draw
            per-prompt seeds from it instead).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        model_path: str | None,
        settings: VllmSettings | dict | None = None,
        seed: int = 0,
    ) -> None:
        import vllm
        from vllm.platforms import current_platform

        # saved hyperparameters hold the settings as a plain dict
        settings = VllmSettings(**settings) if isinstance(settings, dict) else settings or VllmSettings()
        self.tokenizer = tokenizer
        self.lora = is_peft(policy)
        self._workdir = Path(tempfile.mkdtemp(prefix="vllm-engine-"))
        weakref.finalize(self, shutil.rmtree, self._workdir, ignore_errors=True)  # also when never closed
        self._lora_id = 0
        self._lora_request = None
        self.version: object = None
        base = policy.get_base_model() if self.lora else policy
        # options this machine or this model cannot honour are turned off, each with a warning line
        positions = getattr(base.config, "max_position_embeddings", None)
        settings = engine_settings(
            settings, current_platform, positions, cpu_memory() if current_platform.is_cpu() else None
        )
        if model_path is None:
            model_path = str(self._workdir / "model")
            save_base(policy, tokenizer, model_path)
        options = {}
        if self.lora:
            config = next(iter(policy.peft_config.values()))
            options = {"enable_lora": True, "max_loras": 1, "max_lora_rank": settings.max_lora_rank or config.r}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1:
                options["distributed_executor_backend"] = "external_launcher"
                os.environ.update(launcher_environment())
        with no_autocast():  # the engine keeps its own dtype, whatever the trainer's precision plugin has on
            self.llm = vllm.LLM(
                model=model_path,
                tokenizer=model_path,
                dtype=str(next(base.parameters()).dtype).removeprefix("torch."),
                seed=seed,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
                max_model_len=settings.max_model_len,
                enforce_eager=settings.enforce_eager,
                enable_sleep_mode=settings.enable_sleep_mode,
                enable_prefix_caching=True,  # the G completions of a prompt share its prefill
                generation_config="vllm",  # sampling follows the trainer's settings, not the folder's defaults
                logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes them
                use_tqdm_on_load=hf_logging.is_progress_bar_enabled(),  # bars as the console wants them (LOGLEVEL)
                **options,
            )
        ENGINES.add(self)
        self._vllm = vllm
        self.settings = settings
        self.sleep_mode = settings.enable_sleep_mode
        self._asleep = False

    # ---------------------------------------------------------------- the policy

    def serve(self, policy: torch.nn.Module, version: object) -> None:
        """Make the engine sample from `policy`'s current weights, unless it already holds `version` of them."""
        if version == self.version:
            return
        asleep = self._asleep
        if asleep:  # the weights first, the KV cache after the new weights are in: a lower peak (TRL's order)
            self._wake(["weights"])
        if self.lora:
            self._load_adapter(policy)
        else:
            self._push_weights(policy)
        if asleep:
            self._wake(["kv_cache"])
            self._asleep = False
        # cached prefixes hold keys and values of the old weights
        self.llm.reset_prefix_cache()
        self.version = version

    def _wake(self, tags: list[str]) -> None:
        """Take back the engine's memory for `tags`. The update's blocks still cached by PyTorch's allocator go back
        to the GPU first: without that, a card with room for one of the two but not both runs out of memory."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)

    def sleep(self) -> None:
        """Give the engine's GPU memory to the update (sleep mode); `serve` wakes it."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _load_adapter(self, policy: torch.nn.Module) -> None:
        """Save the adapter and have the engine load it under a fresh id (ids name adapters in its caches)."""
        from vllm.lora.request import LoRARequest

        previous = self._lora_request
        self._lora_id += 1
        path = self._workdir / f"adapter-{self._lora_id}"
        policy.save_pretrained(path)
        self._lora_request = LoRARequest(f"policy-{self._lora_id}", self._lora_id, str(path))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _push_weights(self, policy: torch.nn.Module) -> None:
        """Copy every weight of `policy` into the engine's model, in place (vLLM fuses q/k/v and gate/up itself)."""
        weights = ((name, tensor.detach()) for name, tensor in policy.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

    # ---------------------------------------------------------------- sampling

    @torch.no_grad()
    def rollout(
        self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> Rollout:
        """`params.num_generations` completions per prompt, group-major, as `rollout.rollout` returns them.

        Args:
            prompt_ids: Left-padded prompts, [P, Lp].
            prompt_mask: 1 for real prompt tokens, [P, Lp].
            params: What to sample with; the engine does not speculate (`params.speculation` is not read).
            generator: With `seed_each_request`, draws one seed per prompt, so a rollout is reproducible from the
                generator's state; otherwise unused (the engine's own stream samples).

        Returns:
            The `Rollout`, with `logprobs` [P*G, C]: the engine's log-probs of the sampled tokens (0 on padding;
            None when greedy).
        """
        if self._asleep:
            self._wake(["weights", "kv_cache"])
            self._asleep = False
        G = params.num_generations
        greedy = params.temperature == 0
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()}
                   for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]  # fmt: skip
        seeds = [None] * len(prompts)
        if generator is not None and not greedy and self.settings.seed_each_request:
            seeds = torch.randint(2**31 - 1, (len(prompts),), generator=generator).tolist()
        n = G
        if greedy:  # vLLM samples a greedy answer once per request: the group is G requests of one answer
            prompts, seeds, n = [p for p in prompts for _ in range(G)], [None] * len(prompts) * G, 1
        requests = [  # vLLM's own sampling parameters, one a request
            self._vllm.SamplingParams(
                n=n,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_ids),
                ignore_eos=True,
                logprobs=None if greedy else 0,
                seed=seed,
                detokenize=False,
                skip_special_tokens=False,
            )  # fmt: skip
            for seed in seeds
        ]
        with no_autocast():
            outputs = self.llm.generate(prompts, requests, lora_request=self._lora_request, use_tqdm=False)
        rows = [completion for request in outputs for completion in request.outputs]  # group-major
        return self._record(prompt_ids, prompt_mask, rows, G, params.stop_ids, with_logprobs=not greedy)

    def _record(
        self, prompt_ids: Tensor, prompt_mask: Tensor, rows, G: int, stop_ids: Sequence[int], with_logprobs: bool
    ) -> Rollout:
        """Pad the engine's completions into the sampler's tensors (pad after the stop token, as the sampler does)."""
        width = max(len(row.token_ids) for row in rows)  # C
        device = prompt_ids.device
        pad = self.tokenizer.pad_token_id
        completion_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [P*G, C]
        completion_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [P*G, C]
        logprobs = torch.zeros((len(rows), width)) if with_logprobs else None  # [P*G, C]
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            completion_ids[i, :n] = torch.tensor(row.token_ids)
            completion_mask[i, :n] = 1
            if logprobs is not None:
                steps = zip(row.token_ids, row.logprobs, strict=True)
                logprobs[i, :n] = torch.tensor([step[token].logprob for token, step in steps])
        stops = torch.tensor(list(stop_ids))
        truncated = ~torch.isin(completion_ids, stops).any(-1)  # [P*G] no stop token within the budget
        texts = completion_texts(self.tokenizer, completion_ids, stop_ids)
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(G, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
            completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            truncated=truncated.to(device),
            texts=texts,
            logprobs=logprobs.to(device) if logprobs is not None else None,
        )

    def close(self) -> None:
        """Shut the engine down now and free its temporary folder. Its shutdown tears down the process groups it
        joined, the default one included (`vllm.distributed.cleanup_dist_env_and_memory`): under DDP that must come
        after the trainer's last collective and before the interpreter's exit (`close_engines`)."""
        shutil.rmtree(self._workdir, ignore_errors=True)
        if self.llm is not None:
            shutdown_vllm(self.llm)
            self.llm = None
        ENGINES.discard(self)

"""A rehearsal of a config on a CPU (`python cli.py check --config CONFIG --rehearse`): the fit the config describes,
run as written, on a small random model of the same family, before a GPU hour is spent on it.

The model folder's family is shrunk (`shrink`): its tokenizer, vocabulary, chat template, generation config and
architecture, with random weights, 2 layers and a width of 128 (heads of 64, what inference engines run). The fit
then goes through every stage at its true lengths, on the stage's real pairs and on the configured rollout engine
(vLLM's CPU build where the config names vLLM): each stage is passed after its first GRPO step (a forced advance:
threshold 0, no held-out gate); the run stops after one step at the last stage and is saved, resumed from that
checkpoint for one more step, evaluated on 2 held-out pairs at every length, and exported. What it cannot honour
on a CPU (CUDA graphs, bf16 without the instructions) is turned off as every command turns it off
(`interleave_model.runtime.machine`), one line each.

What is made small is only what the CPU's time needs: the model's width and depth, the pairs per stage, the prompts
and samples per step, the held-out pairs. Lengths, tokenizer, prompt template, answer budget, engine, LoRA, loss and
checkpointing are the config's.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import yaml

from interleave_model.evaluation.evaluator import logged_scores
from interleave_model.model.policy import TINY
from interleave_model.model.shipped import resolve_model

# the shrunk model: 2 layers of 128, heads of 64, whatever the family calls these (Llama, Qwen2, GPT-2 names)
SHRINK = {"num_hidden_layers": 2, "n_layer": 2, "hidden_size": 128, "n_embd": 128, "intermediate_size": 256,
          "n_inner": 256, "num_attention_heads": 2, "n_head": 2, "num_key_value_heads": 1, "head_dim": 64}  # fmt: skip


def shrink(name_or_path: str, folder: Path, seed: int = 0) -> Path:
    """A model folder of `name_or_path`'s family in `folder`: the same tokenizer files, chat template, generation config
    and architecture, with `SHRINK`'s sizes and random weights (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    name_or_path = resolve_model(name_or_path)  # a shipped model's name: its cached folder
    config = AutoConfig.from_pretrained(name_or_path)
    for key, value in SHRINK.items():
        if getattr(config, key, None) is not None:
            setattr(config, key, value)
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        model.generation_config = GenerationConfig.from_pretrained(name_or_path)
    except OSError:  # a folder without generation_config.json: the model config's own
        pass
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(name_or_path).save_pretrained(folder)
    return folder


def in_folder(config: dict, root: Path) -> dict:
    """`config` with its runs under `root`: the loggers' folders left to the CLI to place there."""
    config = copy.deepcopy(config)
    config["trainer"]["default_root_dir"] = str(root)
    loggers = config["trainer"].get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if isinstance(logger, dict) and isinstance(logger.get("init_args"), dict):
            logger["init_args"] |= {key: None for key in ("save_dir", "version") if key in logger["init_args"]}
    return config


def fit_args(config_file: Path, model: str, root: Path, stages: list[int], sft_steps: int) -> list[str]:
    """The command line of the rehearsal's fit: the config as written, small where only CPU time is at stake (two
    supervised steps at most), every stage passed after one GRPO step (`Rehearsal` stops it one step into the
    last)."""
    return [
        "--config", str(config_file), "--model.base.name_or_path", model, "--model.base.init_from", "null",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
        "--trainer.strategy", "auto", "--trainer.default_root_dir", str(root),
        "--trainer.max_steps", str(sft_steps + 4 * len(stages) + 8), "--trainer.val_check_interval", "1000000",
        "--trainer.enable_progress_bar", "false",
        "--data.train_pairs", "8", "--data.val_pairs", "2", "--data.test_pairs", "2", "--data.batch_size", "1",
        "--data.sft_steps", str(sft_steps), "--data.sft_batch_size", "2", "--data.eval_batch_size", "2",
        "--data.cache_dir", str(root / "cache"),
        "--data.curriculum.threshold", "0.0", "--data.curriculum.val_threshold", "null",
        "--data.curriculum.patience", "1", "--data.curriculum.min_steps", "1", "--data.curriculum.window", "1",
        "--data.curriculum.adaptive", "null", "--data.curriculum.stop_when_done", "false",
        "--model.sampling.num_generations", "2", "--model.optimization.micro_batch_size", "2",
    ]  # fmt: skip


class Rehearsal(L.Callback):
    """Times each GRPO step by the stage it trained, and stops the fit after `steps_at_last` steps at the last
    stage."""

    def __init__(self, last_words: int, steps_at_last: int = 1):
        self.last_words, self.steps_at_last = last_words, steps_at_last
        self.steps: Counter[int] = Counter()
        self.seconds: Counter[int] = Counter()
        self._began = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._began = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch["phase"] != "grpo":
            return
        words = max(batch["n_words"])
        self.steps[words] += 1
        self.seconds[words] += time.perf_counter() - self._began
        if words == self.last_words and self.steps[words] >= self.steps_at_last:
            trainer.should_stop = True


def rehearse(config: dict, workdir: Path, run: Callable[[list[str], list[L.Callback]], object]) -> list[str]:
    """Rehearse the fit of `config` (a parsed config, as `check` holds it) in `workdir`; its report's lines.

    Args:
        config: The config as a plain dict (its `model.base.name_or_path` names the real folder, or `tiny`).
        workdir: An empty folder: the shrunk model, the config file, the run.
        run: `cli.main`: runs a subcommand from its arguments with extra callbacks, returns the CLI.

    Raises:
        Whatever the fit, the resume or the export raise: the rehearsal stops at the first thing that fails.
    """
    name = config["model"]["base"]["name_or_path"]
    model = name if name == TINY else str(shrink(name, workdir / "model"))
    config_file = workdir / "config.yaml"
    config_file.write_text(yaml.safe_dump(in_folder(config, workdir), sort_keys=False))
    stages = list(config["data"]["stages"])
    args = fit_args(config_file, model, workdir, stages, min(config["data"]["sft_steps"], 2))

    first = Rehearsal(stages[-1])
    cli = run(["fit", *args, "--trainer.limit_val_batches", "0"], [first])  # the resumed fit's evaluation is enough
    reached = cli.datamodule.curriculum.stage_words
    if reached != stages[-1]:
        raise RuntimeError(f"the rehearsal's fit ended at the {reached}-word stage, not at the last ({stages[-1]})")
    checkpoint = Path(cli.trainer.log_dir) / "checkpoints" / "rehearsal.ckpt"
    cli.trainer.save_checkpoint(checkpoint, weights_only=False)  # the full state: the resume reads it
    saved_step = cli.trainer.global_step
    lines = [f"rehearsal: {model} ({'the embedded tiny model' if name == TINY else f'{name} shrunk'}), on a CPU"]
    lines += [f"rehearsal: {n} words: {first.steps[n]} GRPO steps, {first.seconds[n] / first.steps[n]:.1f} s each"
              for n in stages if first.steps[n]]  # fmt: skip
    # its engine, KV cache and all, goes before the resume builds another in this process
    cli.model.sampler.close()
    del cli

    again = Rehearsal(stages[-1])
    resumed = run(["fit", *args, "--ckpt_path", str(checkpoint)], [again])
    step = resumed.trainer.global_step
    if step != saved_step + 1 or resumed.datamodule.curriculum.stage_words != stages[-1]:
        raise RuntimeError(f"the resume from step {saved_step} ended at step {step}, not one step on at the last stage")
    lines.append(f"rehearsal: saved at step {saved_step} at {stages[-1]} words, resumed, step {step}: ok")
    scored = sorted(logged_scores(resumed.trainer.callback_metrics))
    lines.append(f"rehearsal: held-out evaluation at {', '.join(map(str, scored))} words: ok")
    resumed.model.sampler.close()
    del resumed

    out = workdir / "exported"
    run(["export", *args, "--ckpt_path", str(checkpoint), "--output_dir", str(out)], [])
    lines.append(f"rehearsal: exported to {out}: ok")
    return lines

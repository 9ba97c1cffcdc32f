"""Command line: `python cli.py {fit,validate,test,predict,export,check} --config configs/demo.yaml`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from lightning import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from interleave_data.corpus import CorpusError
from interleave_data.datamodule import InterleaveDataModule
from interleave_model.config_keys import MovedKeyError, check_moved_keys
from interleave_model.generation.vllm_engine import close_engines
from interleave_model.model.export import export, load_weights
from interleave_model.model.migrations import migrated_hparams
from interleave_model.model.policy import TINY, PolicyError
from interleave_model.model.positions import CoupledPositionsError
from interleave_model.model.shipped import resolve_model
from interleave_model.module import InterleaveGRPO
from interleave_model.preflight.checks import report, stage_fits
from interleave_model.preflight.estimates import estimate_lines, gpu_gib
from interleave_model.preflight.rehearsal import rehearse
from interleave_model.run.console import ConsoleSummary, StepProgressBar, configure_console
from interleave_model.run.interrupt import StopOnSignal
from interleave_model.run.out_of_memory import SaveOnOutOfMemory, out_of_memory_message
from interleave_model.run.runs import RunError, config_filename, place_run, requeue_save_path
from interleave_model.run.writers import EvaluationReport, PredictionWriter
from interleave_model.runtime.compat import CompatCLI
from interleave_model.runtime.machine import MachineError, settle, settle_engine
from interleave_model.settings import SettingsError

# Errors in what the user gave (a corpus, a model path, an export folder): one line on stderr, exit 2, no traceback.
USER_ERRORS = (
    CorpusError,
    PolicyError,
    CoupledPositionsError,
    FileExistsError,
    RunError,
    MachineError,
    MovedKeyError,
    SettingsError,
)


class InterleaveTrainer(Trainer):
    """The Lightning Trainer plus `export`, so that `cli.py export` reads the same config as training."""

    def export(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
        output_dir: str = "exported",
        merge_lora: bool = False,
    ) -> None:
        """Save a checkpoint's policy and tokenizer as a HF model folder (a peft adapter folder under LoRA).

        Args:
            model: The module built from the config.
            datamodule: Unused; the CLI passes it.
            ckpt_path: Checkpoint whose weights to export; None exports the weights as the config builds them.
            output_dir: Folder to write (see `interleave_model.model.export`).
            merge_lora: Under LoRA, merge the adapter into the base and save a plain model folder.
        """
        checkpoint = load_weights(model, ckpt_path) if ckpt_path else {}
        source = {"checkpoint": ckpt_path and os.path.abspath(ckpt_path), "global_step": checkpoint.get("global_step")}
        export(model, output_dir, merge_lora=merge_lora, source=source)

    def save_checkpoint(self, filepath, weights_only: bool | None = None, storage_options=None) -> None:
        """Lightning's save; the one it makes on SLURM's requeue signal goes into the run's folder, where
        `--ckpt_path last` finds it (`interleave_model.run.runs.requeue_save_path`)."""
        super().save_checkpoint(requeue_save_path(self, filepath), weights_only, storage_options)

    def check(
        self,
        model: LightningModule,
        datamodule: LightningDataModule,
        rehearse: bool = False,
        gpu_memory_gib: float | None = None,
    ) -> None:
        """Check a model folder against the config before spending GPU time on it.

        Prints what was read (stop ids, pad, chat template, BOS), each length's tokens against the model's limit and
        texts per split, the round trip of the target words, and one greedy answer with its score
        (`interleave_model.preflight.checks`). Each problem found is one `error:` line, and the exit status 2.

        Args:
            model: The module built from the config.
            datamodule: The DataModule built from the config.
            rehearse: Then run the config's fit on this CPU, on a small random model of the folder's family: every
                stage at its true lengths, a resume at the last, an export (`interleave_model.preflight.rehearsal`),
                and estimate each stage's GPU memory for the real model (`interleave_model.preflight.estimates`).
            gpu_memory_gib: The GPU those estimates are for; None: this machine's, else an H100 80 GB.
        """
        datamodule.prepare_data()
        datamodule.setup("predict")
        lines, problems = report(model.to(self.strategy.root_device), datamodule)
        print("\n".join(lines))
        if problems:
            raise PolicyError("\nerror: ".join(problems))


class InterleaveCLI(CompatCLI):
    """LightningCLI with the data settings the model also needs linked, so they are written once."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return LightningCLI.subcommands() | {"export": {"model", "datamodule"}, "check": {"model", "datamodule"}}

    def parse_arguments(self, parser: LightningArgumentParser, args: list[str] | None) -> None:
        """Lightning's parse; the arguments are kept as given, for the command that resumes a fit."""
        self.arguments = list(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        """`check` runs on one device, a CPU where there is no GPU; every command gets what this machine can honour
        of its options, or one `error:` line before anything is built (`interleave_model.runtime.machine`)."""
        subcommand = self.config.get("subcommand")
        if subcommand == "check":
            for key, value in {"accelerator": "auto", "devices": 1, "num_nodes": 1, "strategy": "auto"}.items():
                self.config.check.trainer[key] = value
        settle(self.config[subcommand], subcommand)

    def after_instantiate_classes(self) -> None:
        """A vLLM that cannot serve the built model is refused now, or replaced by the own sampler in `check`
        (`interleave_model.runtime.machine.settle_engine`), not met at the first rollout."""
        settle_engine(self.model, self.subcommand)

    def after_check(self) -> None:
        """`check --rehearse`: the config's fit, rehearsed on this CPU in a temporary folder, once the checks pass."""
        if not self.config.check.get("rehearse"):
            return
        config = yaml.safe_load(self._parser("check").dump(self.config.check, skip_none=False, skip_validation=True))
        config.pop("rehearse", None)
        gib = config.pop("gpu_memory_gib", None)
        self.model.sampler.close()  # check's own engine (its greedy answer): the rehearsal's fits build theirs
        argv, sys.argv = sys.argv, sys.argv[:1]  # the rehearsal's commands are `main`'s arguments, not this one's
        try:
            with tempfile.TemporaryDirectory(prefix="rehearsal-") as workdir:
                print("\n".join(rehearse(config, Path(workdir), main)), flush=True)
        finally:
            sys.argv = argv
        name = config["model"]["base"]["name_or_path"]
        if name != TINY:
            from transformers import AutoConfig

            gpu = gpu_gib() if gib is None else (gib, "the GPU named")
            fits = {f.n_words: (f.prompt_tokens, f.answer_tokens) for f in stage_fits(self.model, self.datamodule)}
            stages = {n: fits[n] for n in config["data"]["stages"] if n in fits}
            print("\n".join(estimate_lines(config, stages, AutoConfig.from_pretrained(resolve_model(name)), *gpu)))

    def before_checkpoint_hparams(self, subcommand: str) -> None:
        """One folder per run, placed first: it resolves `--ckpt_path last` to a file (`interleave_model.run.runs`).

        A `fit` that continues a run of this config writes on into it, config included.
        """
        continued = place_run(self.config[subcommand], subcommand)
        if continued is not None:
            self.save_config_kwargs["config_filename"] = config_filename(continued)

    def checkpoint_hparams(self, hparams: dict) -> dict:
        """From the checkpoint, what defines its weights; from this command, everything else, differences printed.

        Lightning lets the checkpoint's values win over the config and the command line (Lightning-AI/
        pytorch-lightning#20801, #21455), so a run resumed with a smaller `micro_batch_size` or a new learning rate
        would silently get the old ones again. The model the weights belong to (`WEIGHT_SETTINGS`: the base model,
        its LoRA shape, the tiny model's shape, template and corpus) comes from the checkpoint; how to train and
        evaluate with it (sampling, loss, optimization, engine, evaluation; the base's memory options) comes from
        this command, and each value that differs from the checkpoint's is printed. A `fit` that names another model
        (base, LoRA shape, tiny shape) is refused in one line. The learning rate is a function of the step
        (`algorithm.schedule`), so a new one takes effect at once. Checkpoints written before the model's settings
        were grouped are read in today's groups (`migrations.migrated_hparams`).
        """
        hparams = migrated_hparams(super().checkpoint_hparams(hparams))
        config = self.config[self.config.subcommand]
        kept = {key: value for key, value in hparams.items() if key in WEIGHT_SETTINGS or key.startswith("_")}
        if isinstance(kept.get("base"), dict):
            kept["base"] = {k: v for k, v in kept["base"].items() if k not in RUN_BASE_SETTINGS}
        _check_tiny_vocabulary(kept, config.data)
        if self.config.subcommand == "fit":
            _check_same_model(kept, config)
            for line in _differences(hparams, kept, config.model):
                print(line, file=sys.stderr)
        return kept

    def trainer_callbacks(self, config: dict, callbacks: list[Callback]) -> list[Callback]:
        """The step progress bar unless the config turns bars off or names its own; always a save and a non-zero exit
        status on SIGTERM or Ctrl-C (`StopOnSignal`), a save and the resume's command on running out of GPU memory
        (`SaveOnOutOfMemory`), and the console summary, last."""
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        bar_wanted = config.get("enable_progress_bar") is not False and importlib.util.find_spec("rich") is not None
        if bar_wanted and not any(isinstance(c, ProgressBar) for c in given + callbacks):
            callbacks = [*callbacks, StepProgressBar()]
        return [*callbacks, StopOnSignal(), SaveOnOutOfMemory(resume_command(self.arguments)), ConsoleSummary()]

    def subcommand_defaults(self, subcommand: str) -> dict:
        """`validate` and `test` default to `verbose: false`: the console summary replaces Lightning's metric table."""
        return {"verbose": False} if subcommand in ("validate", "test") else {}

    def add_arguments_to_parser(self, parser) -> None:
        # the tiny model's tokenizer is built from the same corpus and template the data uses
        parser.link_arguments("data.corpus", "model.corpus")
        parser.link_arguments("data.template", "model.template")
        # the model loads (or builds) the tokenizer, the data tokenizes with it; an object, not a config key
        parser.link_arguments("model.tokenizer", "data.tokenizer", apply_on="instantiate")
        # always on: the per-length report after validate / test, and predictions as JSON lines after predict
        parser.add_lightning_class_args(EvaluationReport, "eval_report")
        parser.add_lightning_class_args(PredictionWriter, "predictions")


# what a checkpoint's weights are the weights of: kept from the checkpoint on resume (`checkpoint_hparams`)
WEIGHT_SETTINGS = ("base", "tiny", "lora", "template", "corpus", "seed")
# the base's settings that change memory or speed, not the weights: this command's
RUN_BASE_SETTINGS = ("gradient_checkpointing", "attn_implementation")


def _differences(hparams: dict, kept: dict, model) -> list[str]:
    """One line per run-time setting whose value in this command differs from the checkpoint's."""
    lines = []
    for group, value in hparams.items():
        if group.startswith("_") or group == "evaluation" or (group in kept and group != "base"):
            continue
        now = model.get(group)
        if isinstance(value, dict):
            now = _plain(now)
            names = RUN_BASE_SETTINGS if group == "base" else value.keys()
            pairs = [(f"model.{group}.{name}", value.get(name), now.get(name)) for name in names]
        else:
            pairs = [(f"model.{group}", value, now if isinstance(now, str | int | float | None) else _plain(now))]
        lines += [f"resume: {key} is {was!r} in the checkpoint, {new!r} here: this command's value is used"
                  for key, was, new in pairs if was != new]  # fmt: skip
    return lines


def _check_same_model(kept: dict, config) -> None:
    """A resumed fit trains the checkpoint's weights: a command naming another base model, LoRA shape or tiny shape
    for them is refused in one line (what it would train does not exist)."""
    model = config.model
    pairs = [("model.base.name_or_path", kept.get("base", {}).get("name_or_path"), model.base.name_or_path)]
    for group in ("lora", "tiny"):
        was, now = kept.get(group), _plain(model.get(group)) or None
        for name in sorted(set(was or {}) | set(now or {})):
            pairs.append((f"model.{group}.{name}", (was or {}).get(name), (now or {}).get(name)))
    changed = [f"{key} is {was!r} in the checkpoint, {now!r} here" for key, was, now in pairs if was != now]
    if changed:
        raise SettingsError(
            f"--ckpt_path continues the checkpoint's model, and this command names another: {'; '.join(changed)}. "
            "Resume without changing them, or start a new run from its weights with --model.base.init_from"
        )


def _plain(value) -> dict:
    """A settings group of the parsed config as a plain dict (a Namespace, a dataclass or None)."""
    if value is None:
        return {}
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return dict(value)


def _check_tiny_vocabulary(hparams: dict, data) -> None:
    """A tiny model's vocabulary is the words of its corpus and template, which the data's settings replace (the CLI
    links them): a checkpoint of it is refused in one line, before it is built, under a config with other ones."""
    if hparams.get("base", {}).get("name_or_path", TINY) != TINY:
        return
    for key in ("template", "corpus"):
        trained = hparams.get(key, data[key])
        if trained != data[key]:
            value = trained if isinstance(trained, str) else json.dumps(trained)
            raise PolicyError(
                f"the checkpoint's tiny model knows the words of data.{key} {trained!r}, this config has "
                f"{data[key]!r}: run with --data.{key} {shlex.quote(value)}"
            )


def main(args: list[str] | None = None, callbacks: list[Callback] | None = None) -> InterleaveCLI:
    """Run the CLI; `args` replaces sys.argv (tests call `main([...])`). Quiet unless `LOGLEVEL` is set.

    `callbacks` join the config's (benchmarks add their clock this way, so an arm runs as the config says)."""
    configure_console()
    if args is None:
        sys.argv[1:] = bare_flags(sys.argv[1:])
    else:
        args = bare_flags(args)
    check_moved_keys(sys.argv[1:] if args is None else args)
    defaults = {"enable_model_summary": False}  # quiet by default; its FLOPs column reads 0 here
    return InterleaveCLI(
        InterleaveGRPO,
        InterleaveDataModule,
        trainer_class=InterleaveTrainer,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # no `optimizer:` / `lr_scheduler:`: AdamW and its schedule are the model's
        trainer_defaults=defaults | ({"callbacks": callbacks} if callbacks else {}),
    )


def bare_flags(args: list[str], flags: tuple[str, ...] = ("--rehearse",)) -> list[str]:
    """A flag written alone (`check --rehearse`) means `--rehearse=true`: the parser's booleans take a value."""
    alone = [a in flags and (i + 1 == len(args) or args[i + 1].startswith("--")) for i, a in enumerate(args)]
    return [f"{a}=true" if bare else a for a, bare in zip(args, alone, strict=True)]


def user_error(err: BaseException) -> BaseException | None:
    """The user's own mistake behind an exception, if any: the exception itself, or what caused it. The parser
    reports a settings group that may be null (`model.lora`, `model.guidance`) as its own error, raised from the
    group's one-line `SettingsError`."""
    while err is not None:
        if isinstance(err, USER_ERRORS):
            return err
        err = err.__cause__
    return None


def resume_command(args: list[str]) -> str:
    """The command that resumes the fit `args` run: the same, with `--ckpt_path last` for any `--ckpt_path` it names."""
    named = {i + 1 for i, arg in enumerate(args) if arg == "--ckpt_path"}  # the value of `--ckpt_path X`
    kept = [arg for i, arg in enumerate(args)
            if i not in named and arg != "--ckpt_path" and not arg.startswith("--ckpt_path=")]  # fmt: skip
    return shlex.join(["python", "cli.py", *kept, "--ckpt_path", "last"])


def run(args: list[str] | None = None) -> int:
    """`main`, with the user's own mistakes reported as one `error:` line and exit status 2, and running out of GPU
    memory as one `error:` line (in a fit: what was saved, what to lower, the command that resumes) and exit status 1:
    the run failed, it was not refused."""
    try:
        main(args)
    except torch.OutOfMemoryError as err:
        print(f"error: {out_of_memory_message(err)}", file=sys.stderr)
        return 1
    except Exception as err:
        mistake = user_error(err)
        if mistake is None:
            raise
        print(f"error: {mistake}", file=sys.stderr)
        return 2
    finally:
        # Lightning leaves a DDP run's process group up; torn down by the interpreter's exit instead, gloo's threads
        # can abort the process ("terminate called without an active exception", exit -6) after a finished fit. A
        # rank's vLLM engine goes first: its shutdown tears down the groups it joined, the default one included. A
        # group of one is vLLM's, in this process, and stays with its engine.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and torch.distributed.get_world_size() > 1:
            close_engines()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run())

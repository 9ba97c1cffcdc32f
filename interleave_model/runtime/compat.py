"""Every use of a private (underscore) or internal API of a library, in one place: Lightning's, torch's and vLLM's.

Each use says what it needs and the version it was tested with, so an upgrade that breaks one breaks here. The rest
of the package uses the public hooks these define. (One more lives in `interleave_data/corpus.py`, which cannot
import this package: `datasets.Dataset._fingerprint`.)
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import torch
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from interleave_model.model.checkpoint import safe_load


class CompatCLI(LightningCLI):
    """LightningCLI whose private steps call public hooks, which a subclass overrides instead of the private steps."""

    def before_checkpoint_hparams(self, subcommand: str) -> None:
        """Called once a subcommand is parsed, before `ckpt_path`'s hyperparameters are read (e.g. to resolve it)."""

    def checkpoint_hparams(self, hparams: dict[str, Any]) -> dict[str, Any]:
        """The model hyperparameters of the `ckpt_path` checkpoint, as they will update the parsed config.

        Override to migrate an older checkpoint's hyperparameters or to keep some config values; default: as saved.
        """
        return hparams

    def trainer_callbacks(self, config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
        """The callbacks the CLI adds to the trainer's configured ones (`config["callbacks"]`); default: as given."""
        return callbacks

    def subcommand_defaults(self, subcommand: str) -> dict[str, Any]:
        """Defaults for the arguments of `subcommand`'s trainer method (e.g. `validate`'s `verbose`); default: none."""
        return {}

    # Re-implements LightningCLI._parse_ckpt_path (lightning 2.6.6) with the two hooks above around its reading.
    @override
    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        self.before_checkpoint_hparams(subcommand)
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if not (ckpt_path and Path(ckpt_path).is_file()):
            return
        hparams = safe_load(ckpt_path, "--ckpt_path").get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        hparams = self.checkpoint_hparams(hparams)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    # LightningCLI._instantiate_trainer (lightning 2.6.6) is where the CLI's own callbacks join the configured ones.
    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        return super()._instantiate_trainer(config, self.trainer_callbacks(config, callbacks))

    # LightningCLI._prepare_subcommand_parser (lightning 2.6.6) builds the parser of one subcommand's arguments.
    @override
    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        defaults = self.subcommand_defaults(subcommand)
        if defaults:
            parser.set_defaults(**defaults)
        return parser


def forget_step_values(trainer: Trainer) -> None:
    """Drop the values logged per step by the batch before, so that a batch hands the loggers only what it logged.

    Lightning keeps every value logged with `on_step` and hands it to the loggers again at each later step of the
    epoch until it is logged anew: the warm-start's loss went on through GRPO, a skipped step repeated the learning
    rate of the step before. The train stream is one endless epoch, so they never ended. Call it as a batch starts,
    before anything of that batch is logged (the module's `on_train_batch_start`; no callback here logs earlier).
    """
    # Trainer._results (lightning 2.6.6) is the running loop's _ResultCollection; resetting one of its entries keeps
    # it from the loggers (and from callback_metrics' update) until it is logged again. Those logged per epoch stay.
    results = trainer._results
    for entry in results.values() if results is not None else ():
        if entry.meta.on_step and not entry.meta.on_epoch:
            entry.reset()


class CompatRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar whose training description a subclass sets through `train_description`."""

    def train_description(self, current_epoch: int) -> str:
        """The text before the training bar; Lightning's `Epoch n/m` by default."""
        return super()._get_train_description(current_epoch)

    # RichProgressBar._get_train_description (lightning 2.6.6) is the only way to change the training bar's text.
    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return self.train_description(current_epoch)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively: on x86, AVX512-BF16 or AMX; other CPUs are taken to have it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    # torch.cpu._is_avx512_bf16_supported and _is_amx_tile_supported (torch 2.13): torch's only word on it
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def can_prepack(device: torch.device) -> bool:
    """Whether oneDNN runs bfloat16 linear layers from prepacked weights here (`prepack_linear_weight`): a CPU whose
    oneDNN has bf16 kernels (torch 2.13's `torch.ops.mkldnn._is_mkldnn_bf16_supported`)."""
    on_cpu = device.type == "cpu" and torch.backends.mkldnn.is_available()
    return on_cpu and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """A bfloat16 linear weight [out, in] reordered into oneDNN's blocked layout for about `rows` rows a call, what
    inductor's CPU weight prepacking emits (`torch.ops.mkldnn._reorder_linear_weight`, torch 2.13)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` with a weight from `prepack_linear_weight` (`torch.ops.mkldnn._linear_pointwise`,
    torch 2.13)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def shutdown_vllm(llm: Any) -> None:
    """Shut a `vllm.LLM` down now, not when it is garbage-collected: `LLM` has no public way to (vllm 0.32), so this
    calls its engine core's `shutdown` (`LLM.llm_engine.engine_core`, the v1 engine's client)."""
    llm.llm_engine.engine_core.shutdown()

"""Callbacks that write evaluation results: the per-length report and figure, and predictions as JSON lines.

`cli.py` adds both to every run (`eval_report:` and `predictions:` in a config set their options).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from typing_extensions import override

from interleave_data.atomic import replacing
from interleave_model.evaluation.report import build_report, curve_figure, save_figure, write_report
from interleave_model.run.runs import run_dir


class EvaluationReport(Callback):
    """After each validation and test, write ``report.json``, ``report.md`` and ``curve.png`` and log the figure.

    The table comes from the module's `eval_results` (synced across ranks); rank 0 writes, each file atomically.
    During `fit` the report is rewritten at every validation, so it always holds the latest one. TensorBoard
    loggers also get the figure as ``{split}/curve`` at the current step.

    Args:
        dirpath: Folder of the report; None means ``<trainer.log_dir>/eval``.
        figure: Draw the score-vs-length figure (needs matplotlib).
    """

    def __init__(self, dirpath: str | None = None, figure: bool = True) -> None:
        self.dirpath = dirpath
        self.figure = figure
        self._checkpoint_step: int | None = None

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # validate / test do not restore the loops, so the module's global_step would read 0
        self._checkpoint_step = checkpoint.get("global_step")

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, pl_module)

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, pl_module)

    def _write(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dirpath = Path(self.dirpath or run_dir(trainer) / "eval")  # every rank: log_dir is a collective
        results = getattr(pl_module, "eval_results", None)
        if trainer.is_global_zero and results and results["lengths"]:
            fitting = trainer.state.fn == TrainerFn.FITTING
            step = results["step"] if fitting or self._checkpoint_step is None else self._checkpoint_step
            self._write_files(trainer, pl_module, results | {"step": step}, dirpath)

    def _write_files(self, trainer: L.Trainer, pl_module: L.LightningModule, results: dict, dirpath: Path) -> None:
        model = _model_info(trainer, pl_module) | {"global_step": results["step"]}
        report = build_report(results, model, _generation_info(pl_module), _data_info(trainer, results["split"]),
                              _run_info(trainer, pl_module))  # fmt: skip
        path = write_report(report, dirpath)
        if self.figure:
            figure = curve_figure(report)
            save_figure(figure, dirpath / "curve.png")
            for logger in trainer.loggers:
                experiment = getattr(logger, "experiment", None)
                if hasattr(experiment, "add_figure"):
                    experiment.add_figure(f"{results['split']}/curve", figure, global_step=results["step"], close=False)
        # rewritten at every validation: the console summary names it once, at the end
        rank_zero_debug(f"evaluation report: {path} (and report.md)")


class PredictionWriter(BasePredictionWriter):
    """Write `predict` records as JSON lines, one per example, in the order of the predict loader.

    Each rank writes its records to ``<output>.rank<r>.part`` as its batches finish; at the end rank 0 joins the
    parts in rank order into the output (written beside it, then renamed into place) and removes them.

    Args:
        output_path: The JSONL file; None means ``<trainer.log_dir>/predictions.jsonl``.
    """

    def __init__(self, output_path: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_path = output_path
        self._path: Path | None = None
        self._file = None

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._path = Path(self.output_path or run_dir(trainer) / "predictions.jsonl")
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._part(trainer.global_rank), "w", encoding="utf-8")  # noqa: SIM115 (closed at the end)

    @override
    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        for record in prediction:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")

    @override
    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._file.close()
        trainer.strategy.barrier("predictions")
        if trainer.is_global_zero:
            self._join(trainer.world_size)
        trainer.strategy.barrier("predictions-joined")

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
            self._part(trainer.global_rank).unlink(missing_ok=True)

    def _join(self, world_size: int) -> None:
        with replacing(self._path) as tmp, open(tmp, "w", encoding="utf-8") as out:
            for rank in range(world_size):
                with open(self._part(rank), encoding="utf-8") as part:
                    out.writelines(part)
        for rank in range(world_size):
            self._part(rank).unlink()
        rank_zero_info(f"predictions: {self._path}")

    def _part(self, rank: int) -> Path:
        return self._path.with_name(f"{self._path.name}.rank{rank}.part")


def _model_info(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    hp = dict(pl_module.hparams)
    checkpoint = trainer.ckpt_path
    return {
        "model_name_or_path": pl_module.base.name_or_path,
        "lora": hp.get("lora"),
        "checkpoint": os.path.abspath(checkpoint) if checkpoint and os.path.exists(checkpoint) else checkpoint,
        "hparams": hp,
    }


def _generation_info(pl_module: L.LightningModule) -> dict[str, Any]:
    sampling, evaluation = pl_module.sampling, pl_module.evaluation
    return {
        "max_new_tokens": sampling.max_new_tokens,
        "budget_margin": sampling.budget_margin,
        "num_samples": evaluation.num_samples,
        "temperature": evaluation.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "pass_k": pl_module.evaluator.pass_k,
        "pass_threshold": evaluation.pass_threshold,
    }


def _data_info(trainer: L.Trainer, split: str) -> dict[str, Any]:
    dm = trainer.datamodule
    if dm is None:
        return {}
    return {
        "corpus": getattr(dm, "corpus", None),
        "dataset_dir": getattr(dm, "dataset_dir", None),
        "template": getattr(dm, "template", None),
        "seed": getattr(dm, "seed", None),
        "eval_stages": getattr(dm, "eval_lengths", None),
        "pairs_per_length": getattr(dm, "pairs", {}).get(split),
        "split_fractions": getattr(dm, "split_fractions", None),
    }


def _run_info(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    import torch
    import transformers

    seed = os.environ.get("PL_GLOBAL_SEED")
    return {
        "seed_everything": int(seed) if seed is not None else None,
        "model_seed": pl_module.hparams.get("seed"),
        "world_size": trainer.world_size,
        "precision": str(trainer.precision),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "lightning": L.__version__},
    }

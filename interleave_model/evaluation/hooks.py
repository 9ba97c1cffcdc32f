"""The module's held-out evaluation: the Lightning hooks of validation, test and predict.

The `Evaluator` (a collaborator) draws the answers through the configured engine, scores them per length and tables
them; these hooks hand it each batch and log its table. A mixin of `InterleaveGRPO`, which provides `evaluator`,
`sampler`, `_rollout` (answers through the configured engine), `_sum_over_ranks` and `_log_step`.
"""

from __future__ import annotations

import time

import torch

from interleave_model.evaluation.evaluator import logged_values, prediction_records


class HeldOutEvaluation:
    """Validation, test and predict: greedy answers (and sampled ones, with `evaluation.num_samples`) scored per
    length; the last evaluation's table in `eval_results`, for the report writer."""

    eval_results: dict | None = None
    _validation_started = 0.0  # perf_counter() as the validation under way began: its cost, `time/val_s`

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluator.update(batch, *self._answers(batch, batch_idx), self.device)

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluator.update(batch, *self._answers(batch, batch_idx), self.device)

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """One record per prompt: the greedy completion, its alignment diagnostics and any sampled answers."""
        return prediction_records(batch, *self._answers(batch, batch_idx))

    def on_validation_epoch_start(self) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_epoch_end(self) -> None:
        """The held-out table, then what the check cost in wall seconds, to weigh against the run's time (which
        lengths a check runs: `data.eval_every_length`)."""
        self.sampler.evaluation_ended()
        self._log_table("val")
        # near equal on every rank (the table's sums wait for the slowest); synced only to keep Lightning quiet
        self.log("time/val_s", time.perf_counter() - self._validation_started, batch_size=1, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self.sampler.evaluation_ended()
        self._log_table("test")

    def on_predict_epoch_end(self) -> None:
        self.sampler.evaluation_ended()

    def greedy(self, batch: dict) -> list[str]:
        """Greedy answers, one per prompt."""
        return self._rollout(batch, num_generations=1, temperature=0.0).texts

    def _answers(self, batch: dict, batch_idx: int) -> tuple[list[str], list[list[str]] | None]:
        """Greedy answers and, with `evaluation.num_samples`, sampled ones (`Evaluator.answers`)."""

        def sample(batch: dict, n: int, temperature: float, generator: torch.Generator | None) -> list[str]:
            return self._rollout(batch, n, temperature, generator).texts

        return self.evaluator.answers(batch, batch_idx, self.global_rank, self.device, sample)

    def _log_table(self, prefix: str) -> None:
        """Log every measure per length and keep the table in `eval_results` (on every rank: all log the same)."""
        rows = self.evaluator.table(self._sum_over_ranks)
        for name, value in logged_values(rows, prefix).items():
            # already equal on every rank; sync_dist (a mean of equal values) only keeps Lightning quiet
            self.log(name, value, batch_size=1, sync_dist=True)
        self._log_step()
        self.eval_results = {"split": prefix, "step": self.global_step, "lengths": rows}

"""DDP on CPU (gloo), two ranks, through the real command line; then the checkpoint resumes on one process.

The curriculum moves after the first GRPO batch, so the ranks must agree on a move, not only on standing still.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from cli import main
from interleave_model.algorithm.rewards import RewardFunction
from interleave_model.algorithm.schedule import PhaseSchedule
from interleave_model.generation.rollout import Rollout
from interleave_model.model.policy import TinyModelConfig
from interleave_model.module import InterleaveGRPO
from interleave_model.settings.loss import Kl, Loss
from interleave_model.settings.optimization import Optimization
from interleave_model.settings.sampling import Sampling
from tests.conftest import TINY_CONFIG, TINY_SHAPE

ROOT = Path(__file__).resolve().parents[1]


class RankReport(L.Callback):
    """Writes what this rank saw at the end of fit to `<folder>/rank<r>.json`."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_end(self, trainer, pl_module):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("curriculum/", "val/"))}
        weights = torch.cat([p.detach().flatten().double() for p in pl_module.policy.parameters()])
        report = {
            "curriculum": trainer.datamodule.curriculum.state_dict(),
            "temperature": pl_module.temperature,
            "metrics": metrics,
            "weights": [weights.sum().item(), weights.abs().sum().item()],
            "global_step": trainer.global_step,
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, sort_keys=True))


CURRICULUM = {"threshold": 0.0, "patience": 1, "min_steps": 1, "window": 2}


def _callbacks(tmp_path: Path) -> list[dict]:
    return [
        {"class_path": "interleave_model.run.callbacks.CurriculumCallback"},
        {"class_path": "interleave_model.run.samples.SampleDump", "init_args": {"every_n_steps": 1}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "save_top_k": 0}},
        {"class_path": "tests.test_ddp.RankReport", "init_args": {"folder": str(tmp_path / "ranks")}},
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_cpu_ranks_agree_write_one_sample_log_and_resume(tmp_path):
    extra = tmp_path / "ddp.yaml"
    trainer = {
        "devices": 2, "strategy": "ddp", "max_steps": 5, "val_check_interval": 4, "limit_val_batches": 1,
        "default_root_dir": str(tmp_path), "callbacks": _callbacks(tmp_path),
        "plugins": [{"class_path": "interleave_model.model.checkpoint.AtomicCheckpointIO"}],
    }  # fmt: skip
    extra.write_text(yaml.safe_dump({"trainer": trainer, "data": {"curriculum": CURRICULUM}}))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "cli.py", "fit", "--config", str(TINY_CONFIG), "--config", str(extra)]

    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)

    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1  # same decisions, curriculum state, synced metrics, same weights
    kinds = [h["kind"] for h in rank0["curriculum"]["history"]]
    assert kinds == ["advance", "done"] and rank0["curriculum"]["stage_index"] == 1
    assert {"curriculum/reward", "curriculum/stage_words", "val/alignment_4w"} <= rank0["metrics"].keys()

    logs = list(tmp_path.rglob("samples.log"))
    assert len(logs) == 1
    heads = [line for line in logs[0].read_text().splitlines() if line.startswith("===")]
    assert len(heads) == 2 * 3  # best and worst once per GRPO batch (batches 2-4), from rank 0 only
    assert len(list(tmp_path.rglob("stages/*words/model.safetensors"))) == 2

    resumed = main([
        "fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path / 'resumed'}",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
        "--trainer.max_steps=7", "--trainer.callbacks+=interleave_model.run.callbacks.CurriculumCallback",
        f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}",
    ])  # fmt: skip
    assert resumed.trainer.global_step == 7
    restored = resumed.datamodule.curriculum.state
    assert restored.history == rank0["curriculum"]["history"] and restored.stage_index == 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("rank", [0, None], ids=["rank-0-signalled", "every-rank-signalled"])
def test_sigterm_stops_both_ranks_at_one_step_saved(tmp_path, rank):
    """`kill <pid>` reaches rank 0 alone, a scheduler every rank (Lightning's own handling hung in both)."""
    extra = tmp_path / "ddp.yaml"
    signal_at = {"class_path": "tests.test_requeue.Signal", "init_args": {"at": 2, "signum": 15, "rank": rank}}
    trainer = {
        "devices": 2, "strategy": "ddp", "max_steps": 50, "limit_val_batches": 0, "default_root_dir": str(tmp_path),
        "callbacks": [*_callbacks(tmp_path)[2:3], signal_at],
    }  # fmt: skip
    extra.write_text(yaml.safe_dump({"trainer": trainer}))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "cli.py", "fit", "--config", str(TINY_CONFIG), "--config", str(extra)]

    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)

    assert done.returncode == 128 + 15, done.stderr[-3000:]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3
    assert (done.stdout + done.stderr).count("fit stopped by SIGTERM after step 3: saved ") == 1  # rank 0 says it


# ---- the math across ranks: dapo's token count and "batch" reward scaling -------------------------------------------


class ScriptedReward(RewardFunction):
    """Completion "k g" (prompt k, sample g) scores (k + 1)**2 * (g + 1) / 10: each rank's spread differs."""

    name = "scripted"

    def __call__(self, completions, targets, truncated):
        return [(int(k) + 1) ** 2 * (int(g) + 1) / 10 for k, g in (c.split() for c in completions)]


class ScriptedGRPO(InterleaveGRPO):
    """Completions fixed by prompt, so that any split of the prompts over ranks trains on the very same rows, and
    plain SGD, so that the update is the gradient itself (AdamW would hide a wrong normaliser). Each GRPO step writes
    what it saw to `<record_dir>/rank<r>.json`."""

    record_dir = ""

    def _rollout(self, batch, num_generations, temperature, generator=None):
        G, pad = num_generations, self.tokenizer.pad_token_id
        # prompt k's sample g has 2 + 2k^2 + g tokens (2, 3 | 4, 5 | 10, 11 | 20, 21): however the sampler splits the
        # four prompts over two ranks, the ranks hold different token counts
        rows = [[10 + (k + g + j) % 20 for j in range(2 + 2 * k * k + g)] for k in batch["ids"] for g in range(G)]
        completion_ids = torch.full((len(rows), max(map(len, rows))), pad)  # [P*G, C]
        completion_mask = torch.zeros_like(completion_ids)  # [P*G, C]
        for i, row in enumerate(rows):
            completion_ids[i, : len(row)], completion_mask[i, : len(row)] = torch.tensor(row), 1
        texts = [f"{k} {g}" for k in batch["ids"] for g in range(G)]
        prompt_ids, prompt_mask = (batch[key].repeat_interleave(G, 0) for key in ("prompt_ids", "prompt_mask"))
        return Rollout(
            prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(len(rows), dtype=bool), texts
        )

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=self.optimization.learning_rate)
        schedule = PhaseSchedule(optimizer, self.optimization, self.trainer.max_steps, lambda: self.phases)
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def grpo_step(self, trajectory, batch):
        stats = super().grpo_step(trajectory, batch)
        record = {"texts": trajectory.rollout.texts, "advantages": trajectory.advantages.tolist()}
        record["loss"] = stats["train/loss"]
        (Path(self.record_dir) / f"rank{self.global_rank}.json").write_text(json.dumps(record))
        return stats

    def on_train_end(self):  # what this rank logged
        logged = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("train/")}
        (Path(self.record_dir) / f"logged{self.global_rank}.json").write_text(json.dumps(logged))


def _collate(items: list[int]) -> dict:
    prompt_ids = torch.tensor([[5 + k, 6, 7] for k in items])  # [P, 3]
    n = len(items)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "prompts": [""] * n,
        "targets": ["x"] * n, "ids": items, "n_words": [4] * n, "phase": "grpo",
    }  # fmt: skip


def _train_one_step(record_dir: Path, devices: int) -> tuple[ScriptedGRPO, list[dict], list[dict]]:
    module = ScriptedGRPO(
        tiny=TinyModelConfig(**TINY_SHAPE), template="compact", rewards=[ScriptedReward()],
        sampling=Sampling(num_generations=2), loss=Loss(loss_type="dapo", scale_rewards="batch"), kl=Kl(beta=0.0),
        optimization=Optimization(learning_rate=0.5, lr_schedule="constant", max_grad_norm=0),
    )  # fmt: skip
    module.record_dir = str(record_dir)
    record_dir.mkdir()
    # two ranks take two prompts each (Lightning's DistributedSampler); one process takes all four
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=4 // devices, collate_fn=_collate)
    strategy = {"strategy": "ddp_fork"} if devices > 1 else {}
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **strategy,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    return module, *_recorded(record_dir)


def _recorded(record_dir: Path) -> tuple[list[dict], list[dict]]:
    """What each rank wrote to `record_dir`, in rank order: what its GRPO step saw, and what it logged."""
    records, logged = ([json.loads(path.read_text()) for path in sorted(record_dir.glob(f"{name}*.json"))]
                       for name in ("rank", "logged"))  # fmt: skip
    return records, logged


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    """One scripted step on one process, and the same step on two gloo ranks: what each saw, logged and trained."""
    tmp_path = tmp_path_factory.mktemp("scripted")
    one, (whole,), (logged_one,) = _train_one_step(tmp_path / "one", devices=1)
    # The two gloo ranks are forked by a fresh process (`__main__` below), which returns rank 0's weights: forked
    # from this one, after other tests' threads (vLLM's engine) ran, a rank could inherit a held lock and hang.
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.test_ddp", str(tmp_path / "two")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    weights = torch.load(tmp_path / "two" / "weights.pt")
    return one, whole, logged_one, weights, *_recorded(tmp_path / "two")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_normalise_and_scale_as_one_process_over_the_whole_batch(one_and_two):
    before = [p.detach().clone() for p in ScriptedGRPO(tiny=TinyModelConfig(**TINY_SHAPE)).policy.parameters()]
    one, whole, _, weights, ranks, _ = one_and_two

    assert len(ranks) == 2 and sorted(ranks[0]["texts"] + ranks[1]["texts"]) == sorted(whole["texts"])
    advantages = dict(zip(whole["texts"], whole["advantages"], strict=True))  # "batch": the std of all 8 rewards
    for rank in ranks:
        assert rank["advantages"] == pytest.approx([advantages[t] for t in rank["texts"]], rel=1e-5)
    # dapo: each rank divides its token sum by (all tokens / 2) and DDP averages the two gradients
    assert (ranks[0]["loss"] + ranks[1]["loss"]) / 2 == pytest.approx(whole["loss"], rel=1e-5)
    # the updates agree: the step moved the weights, and two ranks moved them as one process did
    assert any(not torch.equal(a, b) for a, b in zip(before, one.policy.parameters(), strict=True))
    for (name, a), b in zip(one.policy.named_parameters(), weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_log_the_means_over_both_and_the_advantages_the_loss_used(one_and_two):
    _, whole, logged_one, _, ranks, (rank0, rank1) = one_and_two
    assert rank0 == rank1  # every rank logs the same: the means over the ranks
    assert ranks[0]["loss"] != pytest.approx(whole["loss"], rel=1e-3)  # rank 0's own loss is not the batch's
    # With two prompts a rank, the means over the two ranks are the whole batch's values: dapo's loss (each rank's
    # share of the batch's token sum), the reward, the completions' length, the share of zero-std groups, and the
    # advantages as rescaled by the std of all 8 rewards, which is what the loss used.
    for key in ("train/loss", "train/pg_loss", "train/reward_mean", "train/completion_len",
                "train/frac_zero_std_groups", "train/advantage_abs_mean", "train/lr"):  # fmt: skip
        assert rank0[key] == pytest.approx(logged_one[key], rel=1e-5), key
    mean_abs = sum(abs(a) for a in whole["advantages"]) / len(whole["advantages"])
    assert logged_one["train/advantage_abs_mean"] == pytest.approx(mean_abs, rel=1e-6)


if __name__ == "__main__":  # the two-rank half of the test above: python -m tests.test_ddp FOLDER
    folder = Path(sys.argv[1])
    two, _, _ = _train_one_step(folder, devices=2)
    torch.save([p.detach() for p in two.policy.parameters()], folder / "weights.pt")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_cpu_ranks_climb_the_adaptive_length_together(tmp_path):
    """Every GRPO batch succeeds (`tests.test_resume.Succeeds`), so the length moves after each: both ranks draw the
    same lengths and end in the same state."""
    extra = tmp_path / "ddp.yaml"
    trainer = {"devices": 2, "strategy": "ddp", "max_steps": 6, "limit_val_batches": 0,
               "default_root_dir": str(tmp_path), "callbacks": _callbacks(tmp_path)[::3]}  # fmt: skip
    adaptive = {"success": 1.0, "step": 0.3}
    data = {"stages": [4, 16], "replay_fraction": 0.5, "curriculum": {"adaptive": adaptive}}
    model = {"rewards": [{"class_path": "tests.test_resume.Succeeds"}]}
    extra.write_text(yaml.safe_dump({"trainer": trainer, "data": data, "model": model}))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "cli.py", "fit", "--config", str(TINY_CONFIG), "--config", str(extra)]

    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)

    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    state = rank0["curriculum"]
    # GRPO batches 2-5: levels 4 (the first milestone passes), 5.03, 6.32, 7.94; batch 6, fetched ahead, at 6 words
    assert state["level"] == pytest.approx(7.94, abs=0.01) and state["drawn_words"] == 6
    assert rank0["metrics"]["curriculum/length"] == 8.0 and rank0["metrics"]["curriculum/pass_at_g"] == 1.0

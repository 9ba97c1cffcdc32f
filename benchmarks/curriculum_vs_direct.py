"""A direct jump to a long stage vs the curriculum, on the CPU tiny model. Prints one JSON line.

Both arms start from the same supervised warm-start and get the same GRPO step budget. The warm start mixes the
lengths 2 .. the first stage (`--sft-stages`), as a pretrained model has seen texts of every length; a warm start at
the first stage alone learns position shortcuts that give GRPO no foothold even two words further. The statistics
describe each batch as drawn, before any `--dynamic-sampling` refill.

- `direct` trains at the long stage only, as a run started by hand there would;
- `curriculum` moves through the stages (`CurriculumSettings`, carried out by CurriculumCallback), whose collapse
  watch responds as configured (`--on-collapse`, default step_back) and stops the arm after
  `--max-collapse-responses` responses at one length.

Reported per arm, in bins of `--bin` GRPO batches: the stage, the mean reward of the rows at the batch's stage, the
share of zero-variance groups (all G rewards equal), of stuck groups (equal and below the threshold), of groups whose
G completions are all identical, and the mean completion length in words; the same per stage; the batches run and
those with at least one zero-variance group; the curriculum's transitions and stop message; and the held-out greedy
score at the first and at the long stage at the end.

    python benchmarks/curriculum_vs_direct.py [--stages 10 12 14 16 18 20] [--sft-steps 3000] [--grpo-steps 1200]
        [--warm-from a_warm_start.ckpt] [--arms direct curriculum] [--dynamic-sampling ROUNDS]

Measured (defaults, 2-core CPU, about 25 minutes) in README.md, "The curriculum, measured".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from interleave_data.curriculum import CurriculumSettings
from interleave_data.datamodule import InterleaveDataModule
from interleave_model.callbacks import CurriculumCallback
from interleave_model.dynamic_sampling import DynamicSampling
from interleave_model.grpo import zero_std_groups
from interleave_model.module import InterleaveGRPO
from interleave_model.policy import TinyModelConfig
from interleave_model.settings import grouped_hparams


class Recorder(L.Callback):
    """Per GRPO batch: its stage, the mean reward of its rows at that stage, and group statistics."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        record = outputs.get("record") if isinstance(outputs, dict) else None
        if record is None:
            return
        G, words = record.num_generations, max(record.n_words)
        at = [i for i, n in enumerate(record.n_words) if n == words]
        rewards = record.rewards.view(-1, G)[at]  # [P', G]
        flat = zero_std_groups(rewards.flatten(), G)  # [P']
        texts = [record.completions[i * G : (i + 1) * G] for i in at]
        self.rows.append(
            {
                "words": words,
                "reward": rewards.mean().item(),
                "zero_std": flat.float().mean().item(),
                "stuck": (flat & (rewards.mean(dim=1) < self.threshold)).float().mean().item(),
                "identical": sum(len(set(group)) == 1 for group in texts) / len(texts),
                "length": sum(len(t.split()) for group in texts for t in group) / (len(texts) * G),
            }
        )


def _trainer(max_steps: int, callbacks=(), validate: bool = False) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=1.0 if validate else 0, num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )  # fmt: skip


def _module(args, **overrides) -> InterleaveGRPO:
    width = args.width
    tiny = TinyModelConfig(hidden_size=width, num_layers=args.layers, num_heads=4, intermediate_size=2 * width)
    kwargs = dict(
        tiny=tiny, template="compact", num_generations=args.num_generations, learning_rate=args.learning_rate,
        sft_learning_rate=args.sft_learning_rate, lr_schedule="constant", warmup_steps=20, beta=0.04,
        seed=args.model_seed,
    )  # fmt: skip
    return InterleaveGRPO(**grouped_hparams(kwargs | overrides))  # flat names, grouped as settings name them


def _datamodule(args, stages, module: InterleaveGRPO, **overrides) -> InterleaveDataModule:
    kwargs = dict(
        stages=stages, template="compact", train_pairs=args.train_pairs, val_pairs=32, test_pairs=0,
        batch_size=args.batch_size, sft_batch_size=32, eval_batch_size=32, seed=args.seed, cache_dir=args.cache_dir,
        tokenizer=module.tokenizer,
    )  # fmt: skip
    return InterleaveDataModule(**(kwargs | overrides))


def held_out_score(module: InterleaveGRPO, args, n_words: int) -> float:
    """Greedy alignment score on held-out pairs at `n_words`."""
    dm = _datamodule(args, [n_words], module, eval_stages=[n_words])
    metrics = _trainer(1, validate=True).validate(module, datamodule=dm, verbose=False)[0]
    return round(metrics[f"val/alignment_{n_words}w"], 4)


def warm_start(args, folder: Path) -> Path:
    """Supervised training at the first stage (the two-phase recipe's first phase); returns its checkpoint."""
    L.seed_everything(args.seed, verbose=False)
    module = _module(args, sft_steps=args.sft_steps)
    trainer = _trainer(args.sft_steps)
    dm = _datamodule(args, args.stages[:1], module, sft_steps=args.sft_steps, sft_stages=args.sft_stages)
    trainer.fit(module, datamodule=dm)
    path = folder / "warm.ckpt"
    trainer.save_checkpoint(path)
    return path


# each arm's stages: the direct arm trains at the long stage only
ARMS = {"direct": lambda stages: stages[-1:], "curriculum": lambda stages: stages}


def run_arm(args, warm: Path, stages: list[int], curriculum: bool) -> dict:
    L.seed_everything(args.seed, verbose=False)
    dynamic = DynamicSampling(max_rounds=args.dynamic_sampling) if args.dynamic_sampling else None
    module = _module(args, init_from=str(warm), dynamic_sampling=dynamic)
    settings = CurriculumSettings(
        threshold=args.threshold, patience=args.patience, min_steps=args.min_steps, window=args.patience,
        collapse_patience=args.collapse_patience, on_collapse=args.on_collapse,
        max_collapse_responses=args.max_collapse_responses,
    )  # fmt: skip
    replay = args.replay_fraction if curriculum else 0.0
    dm = _datamodule(args, stages, module, replay_fraction=replay, curriculum=settings)
    recorder = Recorder(args.threshold)
    callbacks: list[L.Callback] = [recorder, CurriculumCallback(export=False)] if curriculum else [recorder]
    started = time.perf_counter()
    _trainer(args.grpo_steps, callbacks).fit(module, datamodule=dm)
    seconds = time.perf_counter() - started
    rows = recorder.rows
    bins = [rows[i : i + args.bin] for i in range(0, len(rows), args.bin)]

    def binned(key: str) -> list[float]:
        return [round(sum(r[key] for r in b) / len(b), 3) for b in bins]

    out = {
        "stages": stages,
        "batches": len(rows),
        "batches_with_a_zero_variance_group": sum(r["zero_std"] > 0 for r in rows),
        "words": [max(r["words"] for r in b) for b in bins],
        "reward": binned("reward"),
        "zero_std_share": binned("zero_std"),
        "stuck_share": binned("stuck"),
        "identical_share": binned("identical"),
        "completion_words": binned("length"),
        "per_stage": {
            n: {
                "batches": len(at),
                "reward": round(sum(r["reward"] for r in at) / len(at), 3),
                "zero_std_share": round(sum(r["zero_std"] for r in at) / len(at), 3),
            }
            for n in stages
            if (at := [r for r in rows if r["words"] == n])
        },
        "held_out_score": {n: held_out_score(module, args, n) for n in (args.stages[0], args.stages[-1])},
        "seconds": round(seconds, 1),
    }
    if curriculum:
        state = dm.curriculum.state
        out["transitions"] = [{key: h[key] for key in ("kind", "to_words", "batch")} for h in state.history]
        out["stopped"] = state.stopped
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stages = [10, 12, 14, 16, 18, 20]
    parser.add_argument("--stages", type=int, nargs="+", default=stages, help="the last is the long stage")
    parser.add_argument("--sft-steps", type=int, default=3000, help="warm-start batches of 32")
    parser.add_argument("--sft-stages", type=int, nargs="+", default=None, help="warm-start lengths (2 .. first stage)")
    parser.add_argument("--warm-from", default=None, help="reuse a warm-start .ckpt of this shape instead")
    parser.add_argument("--grpo-steps", type=int, default=1200, help="GRPO step budget of each arm")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--sft-learning-rate", type=float, default=2e-3)
    parser.add_argument("--train-pairs", type=int, default=20000)
    parser.add_argument("--threshold", type=float, default=0.45, help="rolling mean reward that ends a stage")
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--min-steps", type=int, default=10)
    parser.add_argument("--collapse-patience", type=int, default=5)
    parser.add_argument("--on-collapse", default="step_back")
    parser.add_argument("--max-collapse-responses", type=int, default=2)
    parser.add_argument("--replay-fraction", type=float, default=0.25)
    parser.add_argument("--bin", type=int, default=100, help="GRPO batches per reported bin")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data (split, pairs, stream)")
    parser.add_argument("--model-seed", type=int, default=1, help="seeds the tiny model's init and the sampling")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms to run")
    parser.add_argument("--dynamic-sampling", type=int, default=0, help="refill rounds of DAPO dynamic sampling; 0 off")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    args = parser.parse_args()
    args.sft_stages = args.sft_stages or list(range(2, args.stages[0] + 1))
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        args.cache_dir = os.path.join(folder, "cache")
        warm = Path(args.warm_from) if args.warm_from else warm_start(args, Path(folder))
        warm_score = held_out_score(_module(args, init_from=str(warm)), args, args.stages[0])
        arms = {arm: run_arm(args, warm, ARMS[arm](args.stages), arm == "curriculum") for arm in args.arms}
    result = {
        "benchmark": "curriculum_vs_direct",
        "long_stage_words": args.stages[-1],
        "warm_start": {
            "stage_words": args.stages[0],
            "sft_stages": None if args.warm_from else args.sft_stages,
            "sft_steps": None if args.warm_from else args.sft_steps,
            "held_out_score": warm_score,
        },
        "grpo_steps": args.grpo_steps,
        "bin_batches": args.bin,
        "dynamic_sampling_rounds": args.dynamic_sampling,
        **arms,
        "model": {"width": args.width, "layers": args.layers, "num_generations": args.num_generations},
        "batch_size": args.batch_size,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""What GRPO and the curriculum do to held-out scores on the CPU tiny model. Prints one JSON line per arm.

`lift` and `sft` start from a supervised warm-start at 10 words that ends where a pretrained base stood before GRPO
(Llama-3.2-3B: 0.486 at 10 words): `data.curriculum.warm_start_until`, checked every `--eval-every` batches on
held-out pairs. `curriculum` and `direct` start from a full warm-start (`--ladder-sft-steps` on the 2..10-word mix),
the model the curriculum has to carry to longer lengths. Budgets are wall-clock minutes on this machine, one torch
thread per run.

- `lift`: GRPO alone from the warm start at 10 words, for `--minutes` (target: >= 0.95 held-out within 15).
- `sft`: the same start and the same minutes spent on more supervised steps instead, so a reader sees what GRPO adds.
- `curriculum`: GRPO through `--ladder` (the curriculum's thresholds and replay) from a 2..10-word warm start, for
  `--minutes`: the held-out score at each length as it is passed, and the capability curve at the end.
- `direct`: the same start and minutes, GRPO at the ladder's last length only: its zero-variance share, reward and
  held-out score.

Each arm reports the held-out curve `(GRPO step, seconds, score)` and, per GRPO batch bin, the mean reward and the
share of zero-variance groups (all G rewards equal: no gradient) and of groups whose G completions are identical.

    python benchmarks/efficacy.py --arms lift sft --seeds 0 1 2 --minutes 15
    python benchmarks/efficacy.py --arms curriculum direct --minutes 90

Measured on the 2-core machine: docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import get_args

import lightning as L
import torch
from clock import SAMPLE_KEYS, Clock, binned
from provenance import provenance

from interleave_data.atomic import replacing
from interleave_data.curriculum import CurriculumSettings
from interleave_data.datamodule import InterleaveDataModule
from interleave_data.hints import HintSettings
from interleave_model.algorithm.rewards import AlignmentReward, BothStreamsReward, PrefixReward
from interleave_model.legacy import grouped_hparams
from interleave_model.model.policy import LoraSettings, TinyModelConfig
from interleave_model.module import InterleaveGRPO
from interleave_model.run.callbacks import CurriculumCallback
from interleave_model.settings import AdvantageSign, Credit, GuidanceLoss, LrSchedule, ScaleRewards

REWARDS = {"alignment": AlignmentReward, "both_streams": BothStreamsReward, "prefix": PrefixReward}


class EndOfWarmStart(L.Callback):
    """Stops training after the last warm-start batch, before any GRPO update."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.datamodule.curriculum.warm_start(trainer.datamodule.batches_run):
            trainer.should_stop = True


def _trainer(args, max_steps: int, callbacks, validate_every: int | None, precision: str = "32-true") -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", precision=precision, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks),
        val_check_interval=validate_every, check_val_every_n_epoch=None, limit_val_batches=1.0 if validate_every else 0,
    )  # fmt: skip


def _module(args, seed: int, **overrides) -> InterleaveGRPO:
    tiny = TinyModelConfig(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=256)
    lora = LoraSettings(r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0, top_layers=args.lora_top_layers)
    lora = lora if args.lora_r else None
    kwargs = dict(
        model_name_or_path=args.model, dtype=None if args.model == "tiny" else "float32", lora=lora,
        tiny=tiny, template=args.template, seed=seed, num_generations=args.num_generations,
        temperature=args.temperature, learning_rate=args.learning_rate, sft_learning_rate=args.sft_learning_rate,
        beta=args.beta, lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, epsilon_high=args.epsilon_high,
        scale_rewards=args.scale_rewards, advantage_sign=args.advantage_sign, num_iterations=args.num_iterations,
        loss_type=args.loss_type, credit=args.credit, micro_batch_size=args.micro_batch_size,
        rewards=[REWARDS[args.reward]()],
        guidance=args.guidance, guidance_final=args.guidance_final, guidance_decay_steps=args.guidance_decay_steps,
        guidance_loss=args.guidance_loss,
        reference_in_group=args.reference_in_group, shaping_gamma=args.shaping_gamma,
        merged_copy=args.merged_copy, importance_sampling_cap=args.importance_sampling_cap,
    )  # fmt: skip
    return InterleaveGRPO(**grouped_hparams(kwargs | overrides))  # flat names, grouped as settings name them


def _datamodule(args, module: InterleaveGRPO, stages: list[int], seed: int, **overrides) -> InterleaveDataModule:
    kwargs = dict(
        stages=stages, template=args.template, train_pairs=args.train_pairs, val_pairs=args.val_pairs, test_pairs=0,
        batch_size=args.batch_size, sft_batch_size=args.sft_batch_size, eval_batch_size=args.eval_batch_size, seed=seed,
        cache_dir=args.cache_dir, hints=HintSettings(args.hint_pairs, args.hint_decay_steps),
        tokenizer=module.tokenizer,
    )  # fmt: skip
    return InterleaveDataModule(**(kwargs | overrides))


# the settings a warm start's weights depend on besides model, seed, length, cap and threshold
WARM_SETTINGS = ("lora_r", "lora_top_layers", "template", "sft_learning_rate", "sft_batch_size", "warmup_steps",
                 "train_pairs")  # fmt: skip


def warm_name(args, seed: int, length: int, sft_stages: list[int] | None, steps: int, until: float | None) -> str:
    """The file a warm start is kept in: one built with other LoRA, data or supervised settings is never reused."""
    shaping = {name: getattr(args, name) for name in WARM_SETTINGS} | {"sft_stages": sft_stages}
    shaping |= {"val_pairs": args.warm_val_pairs, "eval_every": args.warm_eval_every}  # the held-out check's
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:8]
    return f"warm-{Path(args.model).name}-{seed}-{length}-{steps}-{until}-{digest}.ckpt"


def warm_start(
    args, seed: int, stages: list[int], sft_stages: list[int] | None, steps: int, until: float | None, folder: Path
) -> tuple[Path, dict]:
    """Supervised steps (at most `steps`) until the held-out score at `stages[0]` reaches `until`; the weights.

    Kept in `folder` under `warm_name`: a second process (`--warm-dir`) reuses it."""
    path = folder / warm_name(args, seed, stages[0], sft_stages, steps, until)
    if path.exists():
        return path, json.loads(path.with_suffix(".json").read_text())
    L.seed_everything(seed, verbose=False)
    module = _module(args, seed)
    settings = CurriculumSettings(warm_start_until=until)
    dm = _datamodule(
        args, module, stages[:1], seed, sft_steps=steps, sft_stages=sft_stages, curriculum=settings,
        eval_stages=stages[:1], val_pairs=args.warm_val_pairs,
    )  # fmt: skip
    clock = Clock(0.0)  # its held-out curve
    started = time.perf_counter()
    callbacks = [clock, CurriculumCallback(export=False), EndOfWarmStart()]
    _trainer(args, steps, callbacks, args.warm_eval_every).fit(module, dm)
    end = dm.curriculum.state.warm_end or steps
    score = clock.curve[-1][f"{stages[0]}w"] if clock.curve else None
    start = {"sft_steps": end, "held_out": score, "seconds": round(time.perf_counter() - started, 1)}
    path.with_suffix(".json").write_text(json.dumps(start))
    with replacing(path) as tmp:  # the checkpoint last: a kill leaves no warm start that looks whole
        torch.save({"state_dict": module.state_dict()}, tmp)
    return path, start


def run_arm(args, arm: str, seed: int, warm: Path | None, stages: list[int], lengths: list[int]) -> dict:
    """One arm from the warm weights (a checkpoint, or a model folder with `--start`; None: `--model` untrained) for
    `--minutes`; its curve, group statistics and final scores."""
    L.seed_everything(seed, verbose=False)
    start = {} if warm is None else {"model_name_or_path": str(warm)} if warm.is_dir() else {"init_from": str(warm)}
    clock = Clock(args.minutes, cpu=args.clock == "cpu", stop_file=args.stop_file, supervised=arm == "sft")
    callbacks: list[L.Callback] = [clock]
    if arm == "sft":  # supervised steps for the whole budget (a cosine over a horizon it never reaches: flat)
        module = _module(args, seed, **start, warmup_steps=0)
        dm = _datamodule(args, module, stages, seed, sft_steps=10**6, eval_stages=lengths)
    else:
        module = _module(args, seed, **start)
        settings = CurriculumSettings(
            threshold=args.threshold, patience=args.patience, min_steps=args.min_steps, window=args.patience,
            on_collapse="step_back", stop_when_done=True, val_threshold=args.val_threshold if len(stages) > 1 else None,
        )  # fmt: skip
        replay = args.replay_fraction if len(stages) > 1 else 0.0
        dm = _datamodule(args, module, stages, seed, curriculum=settings, replay_fraction=replay, eval_stages=lengths)
        callbacks.append(CurriculumCallback(export=False))
    precision = "bf16-mixed" if args.bf16 else "32-true"  # the arm's; a warm start is always float32
    max_steps = args.max_steps if args.max_steps and arm != "sft" else 10**7  # else the clock ends the arm
    trainer = _trainer(args, max_steps, callbacks, args.eval_every, precision)
    trainer.validate(module, datamodule=dm, verbose=False)  # the start of the curve
    trainer.fit(module, datamodule=dm)
    if clock.curve[-1]["step"] != trainer.global_step:
        trainer.validate(module, datamodule=dm, verbose=False)  # the end
    rows, bin_ = clock.batches, args.bin
    bins = [rows[i : i + bin_] for i in range(0, len(rows), bin_)]

    def binned_logged(key: str) -> list[float | None]:  # a value a batch may lack (no gradient norm on a skip)
        return [round(sum(v) / len(v), 3) if (v := [r[key] for r in b if key in r]) else None for b in bins]

    out = {
        "arm": arm, "seed": seed, "stages": stages, "minutes": args.minutes, "clock": args.clock,
        "steps": trainer.global_step, "stopped_early": clock.stopped_early,
        "training_minutes": round(clock.seconds() / 60, 1),
        "eval_s": round(clock.evaluating, 1),
        "curve": clock.curve, "final": {k: v for k, v in clock.curve[-1].items() if k.endswith("w")},
    }  # fmt: skip
    target = args.target
    reached = [p for p in clock.curve if p.get(f"{stages[0]}w", 0) >= target and arm in ("lift", "sft")]
    out[f"seconds_to_{target}"] = reached[0]["s"] if reached else None
    if rows:
        means = binned(rows, bin_, ("reward", "zero_std", "identical"))
        out |= {
            "bin_batches": bin_, "words": [max(r["words"] for r in b) for b in bins], "reward": means["reward"],
            "zero_std_share": means["zero_std"], "identical_share": means["identical"],
            "zero_std_share_all": round(sum(r["zero_std"] for r in rows) / len(rows), 3),
        }  # fmt: skip
        out |= {f"sample_{key}": binned_logged(key) for key in SAMPLE_KEYS}
        out |= {"grad_norm": binned_logged("grad_norm"), "clipped_share": binned_logged("grad_clipped")}
    if arm in ("curriculum", "direct"):
        history = dm.curriculum.state.history
        out["transitions"] = [{k: h[k] for k in ("kind", "to_words", "global_step")} for h in history]
        out["stage_reached"] = dm.curriculum.stage_words
        out["stopped"] = dm.curriculum.state.stopped
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help='"tiny", a shipped model\'s name or a model folder')
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (alpha 2r, all linear layers); 0: all weights")
    parser.add_argument("--lora-top-layers", type=int, default=None, help="adapt only the last N layers; default all")
    parser.add_argument("--loss-type", default="grpo", help='"grpo", "dr_grpo" or "dapo"')
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per update forward; default all")
    parser.add_argument("--template", default="compact", help="prompt template")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="alignment", help="the GRPO arms' reward")
    parser.add_argument("--guidance", type=float, default=0.0, help="mu of the reference guidance (CHORD); 0: off")
    parser.add_argument("--guidance-final", type=float, default=0.0, help="mu after --guidance-decay-steps")
    parser.add_argument("--guidance-decay-steps", type=int, default=0, help="GRPO steps of mu's cosine; 0: constant")
    parser.add_argument(
        "--guidance-loss", choices=get_args(GuidanceLoss), default="phi", help="phi: CHORD-phi's term; ce: plain"
    )
    parser.add_argument(
        "--reference-in-group", action="store_true", help="the known answer joins each group (LUFFY); default: off"
    )
    parser.add_argument("--shaping-gamma", type=float, default=0.1, help="LUFFY's p / (p + gamma) on its tokens")
    parser.add_argument("--sft-batch-size", type=int, default=32, help="pairs per warm-start (and sft arm) step")
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this process")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="budget in wall seconds, or in this process's CPU seconds (runs sharing a machine)",
    )
    parser.add_argument("--warm-dir", default=None, help="keep warm starts here and reuse them (default: a temp dir)")
    parser.add_argument("--arms", nargs="+", default=["lift", "sft"], choices=["lift", "sft", "curriculum", "direct"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each seeds the model and the data")
    parser.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget of each arm after its start")
    parser.add_argument("--ladder", type=int, nargs="+", default=[10, 25, 50, 100], help="the curriculum's lengths")
    parser.add_argument("--warm-start-until", type=float, default=0.45, help="held-out score that ends the warm-start")
    parser.add_argument("--max-sft-steps", type=int, default=1500, help="cap of the warm-start of lift and sft")
    parser.add_argument(
        "--ladder-sft-steps", type=int, default=2000, help="warm-start of curriculum and direct; 0: the model untrained"
    )
    parser.add_argument("--sft-learning-rate", type=float, default=2e-3)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument(
        "--lr-schedule", choices=get_args(LrSchedule), default="constant",
        help="GRPO's rate after warm-up: flat, or a cosine to a tenth of it at --max-steps",
    )  # fmt: skip
    parser.add_argument(
        "--max-steps", type=int, default=None,
        help="GRPO steps after which an arm ends even within --minutes (the cosine's horizon); default: the clock's",
    )  # fmt: skip
    parser.add_argument("--beta", type=float, default=0.01)
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear learning-rate warm-up of each phase")
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--epsilon-high", type=float, default=None)
    parser.add_argument("--scale-rewards", default="group", choices=get_args(ScaleRewards))
    parser.add_argument("--advantage-sign", default="both", choices=get_args(AdvantageSign),
                        help='"both" (GRPO), "positive" (PSR) or "negative" (NSR)')  # fmt: skip
    parser.add_argument("--credit", default="sequence", choices=get_args(Credit), help="model.loss.credit")
    parser.add_argument("--hint-pairs", type=int, default=0, help="data.hints.pairs: the answer's first pairs")
    parser.add_argument("--hint-decay-steps", type=int, default=0, help="data.hints.decay_steps")
    parser.add_argument("--num-iterations", type=int, default=1, help="updates per rollout")
    parser.add_argument("--merged-copy", choices=["float32", "bfloat16"], help="model.sampling.merged_copy")
    parser.add_argument("--importance-sampling-cap", type=float, default=None,
                        help="model.sampling.importance_sampling_cap")  # fmt: skip
    parser.add_argument("--bf16", action="store_true", help="the arms under trainer.precision bf16-mixed")
    parser.add_argument(
        "--start", default=None, help="every arm from this model folder or warm-start checkpoint, no warm-start"
    )
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per GRPO step")
    parser.add_argument("--threshold", type=float, default=0.9, help="rolling reward that passes a curriculum stage")
    parser.add_argument("--val-threshold", type=float, default=0.9, help="held-out score that passes a stage too")
    parser.add_argument("--patience", type=int, default=10)
    parser.add_argument("--min-steps", type=int, default=20)
    parser.add_argument("--replay-fraction", type=float, default=0.25)
    parser.add_argument("--target", type=float, default=0.95, help="held-out score whose time to reach is reported")
    parser.add_argument("--train-pairs", type=int, default=20000)
    parser.add_argument("--val-pairs", type=int, default=64, help="held-out pairs of each evaluation of an arm")
    parser.add_argument("--eval-every", type=int, default=25, help="batches between held-out evaluations")
    parser.add_argument("--warm-val-pairs", type=int, default=None, help="the warm start's; default --val-pairs")
    parser.add_argument("--warm-eval-every", type=int, default=None, help="the warm start's; default --eval-every")
    parser.add_argument(
        "--stop-file",
        default=None,
        help="when this file appears, the running arm ends, is evaluated and printed; no other starts",
    )
    parser.add_argument("--bin", type=int, default=50, help="GRPO batches per reported bin")
    args = parser.parse_args()
    args.warm_val_pairs = args.warm_val_pairs or args.val_pairs
    args.warm_eval_every = args.warm_eval_every or args.eval_every
    torch.set_num_threads(args.threads)
    ladder = args.ladder
    context = provenance(args.threads) | {
        "settings": {k: v for k, v in vars(args).items() if k not in ("arms", "seeds")}
    }
    with tempfile.TemporaryDirectory() as folder:
        args.cache_dir = os.path.join(folder, "cache")
        for seed in args.seeds:
            warm = {}  # one warm start per kind, shared by the arms that start from it
            for arm in args.arms:
                at_ten = arm in ("lift", "sft")
                stages = [ladder[0]] if at_ten else (ladder if arm == "curriculum" else ladder[-1:])
                sft_stages = None if at_ten else list(range(2, ladder[0] + 1))
                kind = "task" if at_ten else "mix"
                if args.start:
                    warm[kind] = Path(args.start), {"from": args.start}
                if not at_ten and args.ladder_sft_steps == 0:
                    warm[kind] = None, {"sft_steps": 0}
                if kind not in warm:
                    steps, until = (
                        (args.max_sft_steps, args.warm_start_until) if at_ten else (args.ladder_sft_steps, None)
                    )
                    keep = Path(args.warm_dir or folder)
                    keep.mkdir(parents=True, exist_ok=True)
                    warm[kind] = warm_start(args, seed, [ladder[0]], sft_stages, steps, until, keep)
                path, start = warm[kind]
                out = run_arm(args, arm, seed, path, stages, [ladder[0]] if at_ten else ladder)
                print(json.dumps({"benchmark": "efficacy", **out, "warm_start": start, **context}), flush=True)
                if out["stopped_early"]:
                    return


if __name__ == "__main__":
    main()

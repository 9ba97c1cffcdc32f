"""Peak memory and time of the supervised warm-start's steps (cross-entropy on the known answers). Prints one JSON line.

Runs `InterleaveGRPO` under a Lightning `Trainer` as `cli.py fit` does in its warm-start phase: `--steps` batches of
`--sft-batch-size` pairs at `--words` words, `--micro-batch-size` rows per forward (`model.optimization
.micro_batch_size`, which the GRPO update takes too). One process per setting: `peak_rss_mb` is its high-water mark
(imports, model and the steps), `start_rss_mb` its memory before the fit starts, `fit_s` the fit's wall time (its set-up
included) and `sft_loss` the last step's cross-entropy.

    python benchmarks/sft_step.py --model smollm2-135m-instruct --lora --sft-batch-size 16 --micro-batch-size 8
"""

from __future__ import annotations

import argparse
import time

import harness
from provenance import provenance


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help='a shipped model\'s name, a folder or "tiny"')
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (r 16, all linear layers)")
    parser.add_argument("--words", type=int, default=10)
    parser.add_argument("--sft-batch-size", type=int, default=16, help="pairs per step (data.sft_batch_size)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per forward; default all")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--template", default="compact")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default torch's choice")
    args = parser.parse_args(argv)

    import torch

    from interleave_data.datamodule import InterleaveDataModule
    from interleave_model.module import InterleaveGRPO
    from interleave_model.settings.policy import LoraSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    lora = LoraSettings(r=16, alpha=32, dropout=0.0) if args.lora else None
    dtype = None if args.model == "tiny" else "float32"
    module = InterleaveGRPO(
        base={"name_or_path": args.model, "dtype": dtype}, lora=lora, template=args.template,
        optimization={"micro_batch_size": args.micro_batch_size},
    )  # fmt: skip
    data = InterleaveDataModule(
        stages=[args.words], template=args.template, train_pairs=max(64, 2 * args.steps * args.sft_batch_size),
        val_pairs=4, test_pairs=0, sft_batch_size=args.sft_batch_size, seed=0, tokenizer=module.tokenizer,
        sft_steps=args.steps,
    )  # fmt: skip
    trainer = harness.quiet_trainer("cpu", None, args.steps)
    start_rss, _ = harness.rss_mb()
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - started
    _, peak = harness.rss_mb()
    out = {
        "benchmark": "sft_step", "model": args.model, "lora": args.lora, "words": args.words,
        "sft_batch_size": args.sft_batch_size, "micro_batch_size": args.micro_batch_size, "steps": args.steps,
        "fit_s": round(seconds, 2), "peak_rss_mb": peak, "start_rss_mb": start_rss,
        "sft_loss": round(float(trainer.callback_metrics["train/sft_loss"]), 4),
    } | provenance(args.threads)  # fmt: skip
    harness.emit(out)
    return out


if __name__ == "__main__":
    main()

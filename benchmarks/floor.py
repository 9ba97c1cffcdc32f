"""The floor of one GRPO step on this machine, and how far the step is from it. Prints one JSON line.

The machine: torch's float32 matmul rate at `--threads` on the rollout's shape (the running rows times one MLP
projection) and on the update's (a few thousand tokens through it), and the memory bandwidth (a copy of 512 MiB,
bytes read plus written).

The step's work, counted for the model and the batch it really ran (prompt and completion tokens as the step saw
them; the untrained model runs to the token budget): with `N` the weights of the decoder's linear layers (the
adapter's included) and `H` those of the output layer,

- rollout: each group's prompt prefilled once (2N per token, attention 4 x hidden x layers x context), then one
  decode step per completion token for every row (2N + 2H + attention); bytes: the weights read once per decode step;
- update: one forward over each group's prompt once and every completion (2N per token, 2H per completion token),
  and a backward of the same count (with the base weights frozen under LoRA only the inputs' gradients flow, 2N per
  token; without LoRA the weights' gradients double it); the reference forward when beta > 0.

The floor of a phase is the larger of its FLOPs over the matmul rate of its shape and its bytes over the bandwidth;
`share` is floor / measured, per phase and for the step (rollout + update), in wall time;
`share_of_cpu_time` is the step's floor over the CPU time the process spent in the step (reward and data included),
the figure to read when other jobs share the machine and `--threads` is 1. The step is `grpo_step.py`'s (the module
under a Lightning Trainer, LoRA r=16 with `--lora`): this script imports that one as a module, as the scripts import
`harness`, for its arguments (`parse_args`, given this script's values) and its `build`, so the floor is always of
the step `grpo_step.py` measures, with its defaults; importing it runs nothing.

    python benchmarks/floor.py [--model smollm2-135m-instruct] [--threads 2] [--words 10] [--prompts 4]
                               [--generations 8] [--lora] [--beta 0] [--steps 2] [--warmup 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import grpo_step
import harness
from provenance import provenance


def known_micro_batch(value: str) -> int | None:
    """A `--micro-batch-size` of known size: a number of rows or "all"; "auto" is refused (the floor counts the
    work of the size it names)."""
    size = harness.micro_batch(value)
    if size == "auto":
        raise argparse.ArgumentTypeError("a floor needs a known size: a number of rows or all, not auto")
    return size


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """This benchmark's arguments, and `grpo_step.py`'s for the step it runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help='a model folder, shipped name or "tiny"')
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--words", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--template", default="compact", help="prompt template (configs/smollm2.yaml's)")
    parser.add_argument("--merged-copy", default=None, choices=["float32", "bfloat16"],
                        help="the rollout from a merged copy of this dtype; its floor in it")  # fmt: skip
    parser.add_argument("--bf16", action="store_true", help="the update under bf16-mixed; its floor in bfloat16")
    parser.add_argument("--micro-batch-size", type=known_micro_batch, default=None,
                        help="rows per update forward, or all (default); never auto")  # fmt: skip
    ours = parser.parse_args(argv)
    levers = (["--lora"] if ours.lora else []) + (["--bf16"] if ours.bf16 else [])
    levers += ["--merged-copy", ours.merged_copy or "none"]  # a floor needs the dtype: never grpo_step's auto
    levers += ["--micro-batch-size", str(ours.micro_batch_size or "all")]
    step = grpo_step.parse_args(["--words", str(ours.words), "--steps", str(ours.steps), "--warmup", str(ours.warmup),
                       "--prompts", str(ours.prompts), "--generations", str(ours.generations), "--beta",
                       str(ours.beta), "--model", ours.model, "--threads", str(ours.threads), "--template",
                       ours.template, *levers])  # fmt: skip
    return ours, step


def phase_dtypes(args: argparse.Namespace) -> dict[str, str]:
    """The dtype each phase's matmuls run in: the rollout's the merged copy's (else float32), the update's bfloat16
    under `--bf16`."""
    return {"rollout": args.merged_copy or "float32", "update": "bfloat16" if args.bf16 else "float32"}


def matmul_rate(rows: int, inner: int, outer: int, dtype: str = "float32", repeats: int = 5, batch: int = 0,
                operands: int = 1) -> float:  # fmt: skip
    """FLOP/s of `[rows, inner] @ [inner, outer]` in `dtype` at torch's thread count (with `batch`, `batch` such
    products at once, each its own right side: `[batch, rows, inner] @ [batch, inner, outer]`): the median of
    `repeats` timings, each long enough to time (at least 0.2 s of products). With one thread it is timed in CPU time
    (`clock`). With `operands` > 1 the products cycle through that many right sides, as a decode step reads each
    layer's own: a right side that fits in the CPU's cache would be timed faster than the step reads it."""
    import torch

    clock = _clock()
    kind = getattr(torch, dtype)
    stack = (batch,) if batch else ()
    a = torch.randn(*stack, rows, inner, dtype=kind)
    rights = [torch.randn(*stack, inner, outer, dtype=kind) for _ in range(operands)]
    flops = 2 * max(batch, 1) * rows * inner * outer
    calls = operands * max(1, int(2e8 // (flops * operands)) + 1)
    a @ rights[0]  # warm-up
    times = []
    for _ in range(repeats):
        start = clock()
        for call in range(calls):
            a @ rights[call % operands]
        times.append((clock() - start) / calls)
    return flops / statistics.median(times)


def _clock():
    """CPU time with one torch thread (the work's own time, whatever else runs on the machine), else wall time."""
    import torch

    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a tensor copy (read plus written), the median of `repeats`."""
    import torch

    clock = _clock()
    source = torch.ones(mib * 2**18)  # float32
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start = clock()
        target.copy_(source)
        times.append(clock() - start)
    return 2 * source.numel() * 4 / statistics.median(times)


def merged_weight_bytes(policy, dtype: str) -> int:
    """Bytes of the policy's weights without its adapters, in `dtype`: what a merged copy reads a decode step."""
    import torch

    size = getattr(torch, dtype).itemsize
    return sum(p.numel() for name, p in policy.named_parameters() if "lora_" not in name) * size


def shape_of(policy) -> dict[str, int]:
    """Weights of the decoder's linear layers (adapters included), of the output layer, and the attention's size."""
    import torch

    head = policy.get_output_embeddings()
    linear = sum(p.numel() for m in policy.modules() if isinstance(m, torch.nn.Linear) and m is not head
                 for p in m.parameters(recurse=False))  # fmt: skip
    config = policy.config
    return {
        "linear_weights": linear,
        "head_weights": head.weight.numel(),
        "hidden": config.hidden_size,
        "intermediate": getattr(config, "intermediate_size", 4 * config.hidden_size),
        "layers": config.num_hidden_layers,
        "weight_bytes": harness.weight_bytes(policy),
    }


def step_work(shape: dict, groups: int, rows: int, prompt: float, completion: float, lora: bool, beta: float,
              rollout_weight_bytes: float | None = None) -> dict:  # fmt: skip
    """FLOPs and bytes of one GRPO step's rollout and update (the module docstring's count). `prompt` is a prompt's
    tokens, `completion` the mean completion length over the rows (through the stop token); `rollout_weight_bytes`
    what the rollout reads a decode step when it is not the policy (`shape["weight_bytes"]`): a merged copy's."""
    n, h, attention = shape["linear_weights"], shape["head_weights"], 4 * shape["hidden"] * shape["layers"]
    prefill = groups * prompt * (2 * n + attention * prompt / 2)
    decode = rows * completion * (2 * n + 2 * h + attention * (prompt + completion / 2))
    forward = (groups * prompt + rows * completion) * 2 * n + rows * completion * 2 * h
    forward += attention * (groups * prompt * prompt / 2 + rows * completion * (prompt + completion / 2))
    backward = forward if lora else 2 * forward
    return {
        "rollout_flops": prefill + decode,
        "rollout_bytes": completion * (rollout_weight_bytes or shape["weight_bytes"]),  # weights once a step
        "update_flops": forward + backward + (forward if beta > 0 else 0.0),
        "update_bytes": 3 * shape["weight_bytes"],
    }


def main(argv: list[str] | None = None) -> dict:
    import torch

    harness.offline()
    args, step_args = parse(argv)
    precision = "bf16-mixed" if args.bf16 else "32-true"
    torch.set_num_threads(args.threads)
    trace = provenance(args.threads)  # the commit as the run starts, not as it ends
    with tempfile.TemporaryDirectory() as cache:
        torch.manual_seed(0)
        module, data = grpo_step.build(step_args, args.words, cache)
        records = harness.time_phases(module, harness.mark)
        seen: list[tuple[float, float]] = []  # (prompt tokens, mean completion tokens) of each step
        generate = module.generate_trajectory

        def counted(batch):
            trajectory, stats = generate(batch)
            roll = trajectory.rollout
            seen.append((float(roll.prompt_mask[0].sum()), float(roll.completion_mask.sum(-1).float().mean())))
            return trajectory, stats

        module.generate_trajectory = counted
        harness.quiet_trainer("cpu", precision, args.warmup + args.steps).fit(module, datamodule=data)
        measured = harness.summarize([*records, harness.mark()], args.warmup, None)
    shape = shape_of(module.policy)
    rows = args.prompts * args.generations
    prompt = statistics.mean(p for p, _ in seen[args.warmup :])
    completion = statistics.mean(c for _, c in seen[args.warmup :])
    dtypes = phase_dtypes(args)
    copy_bytes = merged_weight_bytes(module.policy, args.merged_copy) if args.merged_copy else None
    work = step_work(shape, args.prompts, rows, prompt, completion, args.lora, args.beta, copy_bytes)
    update_rows = int(args.prompts * prompt + rows * completion)
    rates = {
        "rollout_matmul_flops_per_s": matmul_rate(rows, shape["hidden"], shape["intermediate"], dtypes["rollout"]),
        "update_matmul_flops_per_s": matmul_rate(update_rows, shape["hidden"], shape["intermediate"], dtypes["update"]),
        "bandwidth_bytes_per_s": bandwidth(),
    }
    floor = {
        "rollout": max(work["rollout_flops"] / rates["rollout_matmul_flops_per_s"],
                       work["rollout_bytes"] / rates["bandwidth_bytes_per_s"]),
        "update": max(work["update_flops"] / rates["update_matmul_flops_per_s"],
                      work["update_bytes"] / rates["bandwidth_bytes_per_s"]),
    }  # fmt: skip
    floor["step"] = floor["rollout"] + floor["update"]
    seconds = {"rollout": measured["rollout_s"], "update": measured["update_s"]}
    seconds["step"] = seconds["rollout"] + seconds["update"]
    record = {
        "benchmark": "floor",
        "model": args.model,
        "words": args.words,
        "prompts": args.prompts,
        "generations": args.generations,
        "lora": args.lora,
        "beta": args.beta,
        "merged_copy": args.merged_copy,
        "micro_batch_size": args.micro_batch_size,
        "precision": precision,
        "matmul_dtype": dtypes,
        "prompt_tokens": round(prompt, 1),
        "completion_tokens": round(completion, 1),
        "shape": shape,
        "gflops_per_s": {
            k.removesuffix("_matmul_flops_per_s"): round(v / 1e9, 2) for k, v in rates.items() if "matmul" in k
        },  # fmt: skip
        "bandwidth_gb_per_s": round(rates["bandwidth_bytes_per_s"] / 1e9, 2),
        "gflop": {"rollout": round(work["rollout_flops"] / 1e9, 2), "update": round(work["update_flops"] / 1e9, 2)},
        "floor_s": {k: round(v, 3) for k, v in floor.items()},
        "measured_s": {k: round(v, 3) for k, v in seconds.items()},
        "share": {k: round(floor[k] / seconds[k], 3) for k in floor},
        "step_wall_s": measured["step_s"],
        # with one thread, CPU time is the step's own work even when other jobs share the machine
        "step_cpu_s": measured["step_cpu_s"],
        "share_of_cpu_time": round(floor["step"] / measured["step_cpu_s"], 3),
        **trace,
    }
    harness.emit(record)
    return record


if __name__ == "__main__":
    main()

"""Running out of GPU memory in a fit: the state before the step that ran out is saved as `last.ckpt`, one `error:`
line says what to lower and the command that resumes, the exit status is 1, and that command goes on from the step.

The error is raised inside a step by hand, on the CPU: `torch.OutOfMemoryError` is CUDA's out-of-memory error."""

from __future__ import annotations

import shlex

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

from cli import main, resume_command, run
from interleave_model.module import InterleaveGRPO
from interleave_model.run.out_of_memory import (
    PASSES,
    SAMPLING,
    VALIDATING,
    Knob,
    MemorySettings,
    memory_knobs,
    out_of_memory_line,
    out_of_memory_message,
    ran_out_in,
    why_not_saved,
)
from tests.conftest import TINY_CONFIG
from tests.test_requeue import RUN_CONFIG, Signal

TORCH_SAYS = "CUDA out of memory. Tried to allocate 2.00 GiB."


def _args(tmp_path) -> list[str]:
    config = tmp_path / "run.yaml"
    config.write_text(RUN_CONFIG.replace("every_n_train_steps: 4", "every_n_train_steps: 100"))  # no periodic save
    return ["fit", "--config", str(TINY_CONFIG), "--config", str(config), f"--trainer.default_root_dir={tmp_path}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.limit_val_batches=0", "--trainer.max_steps=6",
            "--trainer.callbacks+=tests.test_requeue.Signal"]  # fmt: skip


def _run_out(monkeypatch, hook: str, step: int) -> None:
    """Have `InterleaveGRPO.<hook>` raise CUDA's out-of-memory error at `step`, once."""
    original = getattr(InterleaveGRPO, hook)

    def ran_out(self, *args, **kwargs):
        if self.global_step == step:
            monkeypatch.setattr(InterleaveGRPO, hook, original)
            raise torch.OutOfMemoryError(TORCH_SAYS)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InterleaveGRPO, hook, ran_out)


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(("hook", "step"), [("sft_step", 1), ("grpo_step", 3)], ids=["warm-start", "grpo"])
def test_a_step_that_runs_out_is_saved_before_it_and_the_line_resumes_it(tmp_path, monkeypatch, capsys, hook, step):
    args = _args(tmp_path)
    _run_out(monkeypatch, hook, step)

    assert run(args) == 1

    line = _error_line(capsys)
    saved = next(tmp_path.rglob("*.ckpt"))
    checkpoint = torch.load(saved, weights_only=False)
    # the state before the step: its weights, and the data stream at the batch that ran out, to run it again
    assert saved.name == "last.ckpt" and checkpoint["global_step"] == step
    assert checkpoint["InterleaveDataModule"]["batches_run"] == step and checkpoint["optimizer_states"]
    assert line.startswith(f"error: fit ran out of GPU memory in a forward or backward pass at step {step}: "
                           f"saved the state before it as {saved}; resume with the same gradient in smaller forwards: "
                           f"python cli.py fit --config {TINY_CONFIG}")  # fmt: skip
    command = shlex.split(line.split(": ", 3)[3].split(" (or ")[0])
    assert command[:2] == ["python", "cli.py"]
    assert command[-4:] == ["--ckpt_path", "last", "--model.optimization.micro_batch_size", "2"]  # of 2 x 2 rows

    cli = main(command[2:])  # the command the line gives

    resumed = next(c for c in cli.trainer.callbacks if isinstance(c, Signal))
    assert resumed.first_step == step and cli.trainer.global_step == 6
    assert cli.model.micro_batch_size == 2
    assert "resume: model.optimization.micro_batch_size is None in the checkpoint, 2 here" in capsys.readouterr().err


@pytest.mark.slow
def test_a_batch_that_made_an_update_before_running_out_counts_as_run(tmp_path, monkeypatch):
    _run_out(monkeypatch, "grpo_step", 3)  # batch 2's second update: its first made step 2

    assert run([*_args(tmp_path), "--model.loss.num_iterations=2"]) == 1

    checkpoint = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=False)
    assert checkpoint["global_step"] == 3 and checkpoint["InterleaveDataModule"]["batches_run"] == 3


@pytest.mark.slow
def test_running_out_inside_the_optimizers_update_saves_nothing(tmp_path, monkeypatch, capsys):
    _run_out(monkeypatch, "on_before_optimizer_step", 3)  # the guard's clipping: after the update began, to us

    assert run(_args(tmp_path)) == 1

    assert not list(tmp_path.rglob("*.ckpt"))
    line = _error_line(capsys)
    assert "at step 3: nothing saved (it ran out inside the optimizer's update" in line
    assert "--ckpt_path last goes on from the last periodic save" in line


@pytest.mark.slow
def test_running_out_while_sampling_names_the_rollouts_settings(tmp_path, monkeypatch, capsys):
    calls = []

    def rollout(*args, **kwargs):  # the own sampler's, as `Sampler.rollout` calls it
        calls.append(1)
        raise torch.OutOfMemoryError(TORCH_SAYS)

    monkeypatch.setattr("interleave_model.generation.sampler.rollout", rollout)

    assert run([*_args(tmp_path), "--model.sampling.num_generations=4"]) == 1

    line = _error_line(capsys)
    assert len(calls) == 1 and "fit ran out of GPU memory while sampling at step 2: saved " in line  # GRPO's first
    assert line.endswith("--ckpt_path last --data.batch_size 1 (or --model.sampling.num_generations 2: fewer "
                         "completions a prompt)")  # fmt: skip


@pytest.mark.slow
def test_running_out_before_the_fit_starts_leaves_the_checkpoints_alone(tmp_path, monkeypatch, capsys):
    _run_out(monkeypatch, "configure_optimizers", 0)  # a resumed run's state is not restored yet

    assert run(_args(tmp_path)) == 1

    assert not list(tmp_path.rglob("*.ckpt"))
    assert _error_line(capsys) == f"error: {TORCH_SAYS}"  # no step ran: torch's message says it


def test_the_update_lowers_its_rows_a_forward_first_then_checkpoints_then_the_rows_a_step():
    settings = MemorySettings(prompts=4, generations=8, rows_a_forward=32, checkpointing=False, engine_awake=True,
                              eval_prompts=16, eval_samples=8)  # fmt: skip

    knobs = memory_knobs(PASSES, settings)

    assert [(k.flag, k.value) for k in knobs] == [
        ("--model.optimization.micro_batch_size", "16"),
        ("--model.base.gradient_checkpointing", "true"),
        ("--model.vllm.enable_sleep_mode", "true"),
        ("--data.batch_size", "2"),
        ("--model.sampling.num_generations", "4"),
    ]
    assert memory_knobs(SAMPLING, settings) == knobs[-2:]  # the rows a step: the rollout's KV cache
    validating = memory_knobs(VALIDATING, settings)
    assert [(k.flag, k.value) for k in validating] == [
        ("--data.eval_batch_size", "8"),
        ("--model.evaluation.num_samples", "4"),
    ]
    smallest = MemorySettings(1, 2, 1, checkpointing=True, engine_awake=False, eval_prompts=1, eval_samples=0)
    assert memory_knobs(None, smallest) == []  # nothing left to lower: a smaller model, or a bigger GPU


def test_an_evaluation_inside_a_fit_is_told_from_a_training_step():
    def validation_step():  # the module's hook, as a sanity check or a validation inside the fit runs it
        raise torch.OutOfMemoryError(TORCH_SAYS)

    with pytest.raises(torch.OutOfMemoryError) as ran_out:
        validation_step()

    assert ran_out_in(ran_out.value) == VALIDATING


def test_the_line_names_what_was_not_saved_and_the_command_with_the_first_knob():
    knobs = [Knob("--data.batch_size", "2", "fewer prompts a step"), Knob("--x", "1", "y")]

    line = out_of_memory_line("fit ran out of GPU memory at step 7", None, "why", knobs, "python cli.py fit a")

    assert line == ("fit ran out of GPU memory at step 7: nothing saved (why), --ckpt_path last goes on from the last "
                    "periodic save; resume with fewer prompts a step: python cli.py fit a --data.batch_size 2 "
                    "(or --x 1: y)")  # fmt: skip


def test_only_rank_zero_saves_and_only_a_strategy_that_holds_the_whole_state_there():
    assert why_not_saved(False, SingleDeviceStrategy("cpu"), True) is None
    assert why_not_saved(False, DDPStrategy(), True) is None
    assert why_not_saved(False, DDPStrategy(), False) == "only rank 0 saves, and it may be waiting on this rank"
    assert why_not_saved(False, FSDPStrategy(), True) == "FSDPStrategy saves only with every rank"
    assert why_not_saved(True, DDPStrategy(), True).startswith("it ran out inside the optimizer's update")


def test_the_resume_command_replaces_the_checkpoint_named():
    args = ["fit", "--config", "a b.yaml", "--ckpt_path", "x.ckpt", "--ckpt_path=y.ckpt", "--trainer.max_steps=9"]

    command = resume_command(args)

    assert command == "python cli.py fit --config 'a b.yaml' --trainer.max_steps=9 --ckpt_path last"


def test_outside_a_fit_the_line_is_torchs_message():
    assert out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory.\nTried")) == "CUDA out of memory. Tried"

"""`python cli.py fit` end to end on the tiny config: checkpoints, TensorBoard scalars, clear config errors."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cli import main, run
from interleave_model.algorithm.rewards import AlignmentReward, RewardFunction
from interleave_model.model.migrations import CHECKPOINT_VERSION
from tests.conftest import TINY_CONFIG, flat_settings

GPU_CONFIG = Path(__file__).parents[1] / "configs" / "llama-3.2-3b.yaml"
NO_GPU = "trainer.accelerator is 'gpu', but this machine has no GPU: run with --trainer.accelerator cpu"

SCALARS = [
    "train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/reward_mean", "train/reward_std",
    "train/frac_zero_std_groups", "train/clip_frac", "train/completion_len", "train/truncated_frac",
    "train/advantage_abs_mean", "train/sft_loss", "time/rollout_s", "time/reward_s", "time/update_s", "time/val_s",
    "train/a_accuracy", "train/b_accuracy", "train/length_ratio", "train/copy_share", "train/grad_norm",
    "train/grad_clipped", "val/a_accuracy_4w", "val/copy_share_4w", "val/length_ratio_4w",
    "val/alignment_4w", "val/alignment_8w",
]  # fmt: skip


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    cli = main(["fit", "--config", str(TINY_CONFIG), "--trainer.default_root_dir", str(root)])
    return cli, root


def test_fit_logs_every_documented_scalar(fitted):
    cli, _ = fitted
    events = EventAccumulator(cli.trainer.logger.log_dir).Reload()
    missing = [tag for tag in SCALARS if tag not in events.Tags()["scalars"]]
    assert not missing
    assert cli.trainer.global_step == 4 and cli.model.reference is not None  # 2 SFT steps, then GRPO began


def test_fit_saves_a_checkpoint_and_the_config(fitted):
    cli, root = fitted
    log_dir = cli.trainer.logger.log_dir
    assert list(root.glob("**/checkpoints/*.ckpt"))
    assert (root / log_dir.split(str(root))[-1].lstrip("/") / "config.yaml").exists()


def test_unknown_config_key_is_a_one_line_error(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  num_generationz: 4\n")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(TINY_CONFIG), "--config", str(typo)])
    assert exit_.value.code != 0
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error) == 1 and "num_generationz" in error[0]


@pytest.mark.parametrize("flag", ["--optimizer", "--lr_scheduler"])
def test_the_optimizer_and_its_schedule_are_not_offered(flag, capsys):
    """AdamW and its per-phase schedule are the model's (`model.optimization`): LightningCLI's own keys, which the
    model would ignore, are neither in the help nor accepted."""
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert flag not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(TINY_CONFIG), flag, "torch.optim.SGD"])
    assert exit_.value.code != 0 and flag in capsys.readouterr().err


CHOICES = ["model.loss.loss_type", "model.kl.estimator", "model.loss.scale_rewards",
           "model.loss.advantage_estimator", "model.tiny.positions", "model.optimization.lr_schedule",
           "model.rollout_engine",
           "data.curriculum.on_collapse", "data.template", "data.predict_split"]  # fmt: skip


@pytest.mark.parametrize("key", CHOICES)
def test_a_mistyped_choice_is_refused_when_the_config_is_parsed(key, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(TINY_CONFIG), f"--{key}", "grp0", f"--trainer.default_root_dir={tmp_path}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if "error:" in line]
    # a group that may be null (`model.tiny`) is named on the line, its key on the next ones
    group, _, name = key.rpartition(".")
    named = key in error[0] or (group in error[0] and f'Parser key "{name}"' in err)
    assert len(error) == 1 and named and "Got value: grp0" in err
    assert not any(tmp_path.iterdir())  # refused before anything was built: no run folder


def test_a_mistyped_choice_in_a_config_file_is_refused_too(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  loss:\n    loss_type: grp0\n")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(TINY_CONFIG), "--config", str(typo), f"--trainer.default_root_dir={tmp_path}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if "error:" in line]
    assert len(error) == 1 and "model.loss.loss_type" in error[0] and "Got value: grp0" in err


def test_a_bad_path_is_a_one_line_error_with_exit_2(tmp_path, capsys):
    missing = tmp_path / "no_such_run" / "last.ckpt"
    args = ["fit", "--config", str(TINY_CONFIG), f"--model.base.init_from={missing}", "--trainer.logger=false"]

    assert run(args) == 2

    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: model.base.init_from: {missing} does not exist"]


@pytest.mark.parametrize(
    "setting, says",
    [
        (["--model.guidance.weight=1.5"], "error: model.guidance.weight must be in (0, 1]"),
        (["--model.lora.r=0"], "error: model.lora.r must be >= 1, got 0"),  # a group that may be null, as guidance
        (["--model.dynamic_sampling.max_rounds=-1"], "error: model.dynamic_sampling.max_rounds must be >= 0"),
        (["--model.loss.loss_type=dr_grpo"], "error: model.loss.loss_type: dr_grpo needs"),  # across groups
    ],
)
def test_a_setting_out_of_range_is_a_one_line_error_with_exit_2(setting, says, capsys):
    assert run(["fit", "--config", str(TINY_CONFIG), "--trainer.logger=false", *setting]) == 2

    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(says)


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_a_gpu_config_without_a_gpu_is_refused_before_anything_is_built(subcommand, tmp_path, capsys, monkeypatch):
    """configs/llama-3.2-3b.yaml asks for a GPU: without one, one line says what to change; no model is loaded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [subcommand, "--config", str(GPU_CONFIG), f"--model.base.name_or_path={tmp_path / 'no_model_here'}",
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip

    assert run(args) == 2

    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error == f"error: {NO_GPU}"
    assert not any(tmp_path.iterdir())


def test_a_tiny_checkpoint_under_another_template_is_refused_with_the_one_it_knows(fitted, tmp_path, capsys):
    """The tiny model's vocabulary holds its template's words: another template would not load, so one line says so."""
    _, fit_root = fitted
    checkpoint = sorted(fit_root.glob("**/checkpoints/*.ckpt"))[-1]
    args = ["validate", "--config", str(TINY_CONFIG), f"--ckpt_path={checkpoint}", "--data.template=two_processes",
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip

    assert run(args) == 2

    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("error: the checkpoint's tiny model knows the words of data.template 'compact'")
    assert error.endswith("run with --data.template compact") and not any(tmp_path.iterdir())


ADAPTIVE_GATED_UNSEEN = ["--data.curriculum.adaptive={success: 0.9}", "--data.curriculum.val_threshold=0.9",
                         "--data.eval_stages=[4]"]  # fmt: skip  # 8 words is gated and never evaluated


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_any_schedule_evaluates_a_checkpoint_the_schedule_and_its_gates_are_fits(subcommand, fitted, tmp_path, capsys):
    """A fixed-stage checkpoint under an adaptive config whose milestone gates are never evaluated: validate and test
    pass no milestone and resume no schedule, so they run; fit refuses the same settings in one line."""
    _, fit_root = fitted
    checkpoint = sorted(fit_root.glob("**/checkpoints/*.ckpt"))[-1]
    common = ["--config", str(TINY_CONFIG), *ADAPTIVE_GATED_UNSEEN, f"--trainer.default_root_dir={tmp_path}"]

    assert run([subcommand, *common, f"--ckpt_path={checkpoint}"]) == 0
    assert run(["fit", *common]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: data.curriculum.val_threshold gates the milestones [8], which are never evaluated")


def test_a_checkpoint_naming_a_removed_setting_loads_resumes_and_exports(fitted, tmp_path, caplog, monkeypatch):
    """`model.optimization.sft_steps` (now the data's alone), `model.loss.credit`, guidance's `loss` and the
    `reference_in_group` group (removed) in a CLI run's checkpoint: each dropped in one line."""
    from interleave_model.model import migrations
    from interleave_model.module import InterleaveGRPO

    monkeypatch.setattr(migrations, "TOLD", set())  # a fresh process
    _, fit_root = fitted
    checkpoint = torch.load(sorted(fit_root.glob("**/checkpoints/*.ckpt"))[-1], weights_only=False)
    del checkpoint[CHECKPOINT_VERSION]  # written before the layout's version was stamped
    checkpoint["hyper_parameters"]["optimization"]["sft_steps"] = 2
    checkpoint["hyper_parameters"]["loss"]["credit"] = "word"
    checkpoint["hyper_parameters"]["guidance"] = {"weight": 0.5, "final": 0.0, "decay_steps": 0, "loss": "phi"}
    checkpoint["hyper_parameters"]["reference_in_group"] = {"shaping_gamma": 0.1}
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)

    with caplog.at_level("INFO"):
        loaded = InterleaveGRPO.load_from_checkpoint(old)  # through the CLI's instantiator, which checks every key
        main(["export", "--config", str(TINY_CONFIG), f"--ckpt_path={old}", f"--output_dir={tmp_path / 'hf'}"])
    assert loaded.optimization.learning_rate == checkpoint["hyper_parameters"]["optimization"]["learning_rate"]
    assert "model.optimization.sft_steps is no longer a setting, ignored" in caplog.text
    assert "model.loss.credit is no longer a setting, ignored (per-word credit had no finding" in caplog.text
    assert loaded.guidance.weight == 0.5 and "model.guidance.loss is no longer a setting, ignored" in caplog.text
    assert "model.guidance.final is no longer a setting, ignored (mu's decay" in caplog.text
    assert "model.guidance.decay_steps is no longer a setting, ignored" in caplog.text
    assert "model.reference_in_group is no longer a setting, ignored" in caplog.text
    assert (tmp_path / "hf" / "config.json").exists()


class Departed(RewardFunction):
    """A reward a run trained with that has left the code since, as `BothStreamsReward` has."""

    name = "departed"

    def __call__(self, completions, targets, truncated):
        return [0.5] * len(completions)


def test_a_checkpoint_holds_neither_its_rewards_nor_its_data_settings(tmp_path):
    """Each command names its rewards and data settings, the checkpoint none (`save_hyperparameters(ignore=
    ["rewards"])`; the data module saves only its curriculum and batch count): a run trained with a reward or a data
    setting that left the code since (`BothStreamsReward`, `hints`) resumes and tests as any other, with what this
    command names."""
    common = ["--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
              "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=false"]  # fmt: skip
    # 2 warm-start steps, then a GRPO step that calls the reward
    trained = main(["fit", *common, "--trainer.max_steps=3", "--model.rewards=[tests.test_cli.Departed]",
                    "--data.replay_fraction=0.5"])  # fmt: skip
    assert "train/reward_departed" in trained.trainer.logged_metrics
    path = tmp_path / "trained.ckpt"
    trained.trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert "rewards" not in checkpoint["hyper_parameters"] and b"Departed" not in path.read_bytes()
    assert "datamodule_hyper_parameters" not in checkpoint
    assert set(checkpoint["InterleaveDataModule"]) == {"curriculum", "batches_run", "curve_passes"}

    resumed = main(["fit", *common, "--trainer.max_steps=4", f"--ckpt_path={path}"])
    assert resumed.trainer.global_step == 4 and "train/reward_alignment" in resumed.trainer.logged_metrics
    assert [type(r) for r in resumed.model.reward_functions] == [AlignmentReward]
    assert resumed.datamodule.curriculum.replay_fraction == 0.0
    tested = main(["test", *common, f"--ckpt_path={path}"])
    assert "test/alignment_4w" in tested.trainer.callback_metrics


def test_a_checkpoint_with_flat_settings_resumes_and_validates_with_them(fitted, tmp_path):
    """A checkpoint written before the settings were grouped: its flat values still build the model."""

    _, fit_root = fitted
    checkpoint = torch.load(sorted(fit_root.glob("**/checkpoints/*.ckpt"))[-1], weights_only=False)
    del checkpoint[CHECKPOINT_VERSION]  # written before the layout's version was stamped
    checkpoint["hyper_parameters"] = flat_settings(checkpoint["hyper_parameters"])
    checkpoint["hyper_parameters"]["top_k"] = 7  # a value no config below names
    old = tmp_path / "flat.ckpt"
    torch.save(checkpoint, old)
    common = ["--config", str(TINY_CONFIG), f"--ckpt_path={old}", f"--trainer.default_root_dir={tmp_path / 'runs'}"]

    evaluated = main(
        ["validate", *common, "--model.optimization.learning_rate=0.5", "--model.evaluation.num_samples=2"]
    )
    model = evaluated.model
    assert model.hparams["tiny"]["hidden_size"] == 32 and model.hparams["template"] == "compact"  # the checkpoint's
    assert model.optimization.learning_rate == 0.5 and model.evaluation.num_samples == 2  # run-time: this command's
    assert model.sampling.top_k == 0  # the config's default, not the checkpoint's 7

    resumed = main(["fit", *common, "--trainer.max_steps=5", "--model.sampling.top_k=3"])
    assert resumed.model.sampling.top_k == 3 and resumed.trainer.global_step == 5


def test_a_resume_takes_this_commands_run_settings_and_keeps_the_checkpoints_model(fitted, tmp_path, capsys):
    _, fit_root = fitted
    checkpoint = sorted(fit_root.glob("**/checkpoints/*.ckpt"))[-1]
    capsys.readouterr()
    resumed = main(["fit", "--config", str(TINY_CONFIG), f"--ckpt_path={checkpoint}", "--trainer.max_steps=5",
                    f"--trainer.default_root_dir={tmp_path}", "--model.optimization.learning_rate=0.5",
                    "--model.optimization.micro_batch_size=1", "--model.sampling.temperature=0.7"])  # fmt: skip

    model = resumed.model
    assert resumed.trainer.global_step == 5 and model.optimization.micro_batch_size == 1
    assert model.temperature == 0.7  # the rollout's, not the checkpoint's 1.0
    # the rate is a function of the step, so the new base rate is the one step 4 used: 0.5 x its cosine factor
    used = resumed.trainer.optimizers[0].param_groups[0]["lr"]
    assert model.optimization.learning_rate == 0.5
    # GRPO from step 2 to 5, cosine to 10%: at step 4, 2/3 of the way, 0.1 + 0.9 * 0.5 * (1 + cos(2 pi / 3)) = 0.325
    assert used == pytest.approx(0.5 * 0.325)
    assert model.policy.config.hidden_size == 32  # the weights' shape: the checkpoint's
    err = capsys.readouterr().err
    assert "resume: model.optimization.learning_rate is 0.001 in the checkpoint, 0.5 here" in err
    assert "model.optimization.micro_batch_size is None in the checkpoint, 1 here" in err
    assert "model.sampling.temperature is 1.0 in the checkpoint, 0.7 here: this command's value is used" in err
    assert "model.tiny" not in err  # not a run-time setting: nothing to report, the checkpoint's is used


@pytest.mark.parametrize("change", ["--model.lora.r=8", "--model.tiny.hidden_size=64"])
def test_a_resumed_fit_naming_another_model_is_refused_in_one_line(tmp_path, capsys, change):
    common = ["fit", "--config", str(TINY_CONFIG), "--model.lora.r=4", "--trainer.logger=false"]
    cli = main([*common, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=3"])
    cli.trainer.save_checkpoint(tmp_path / "lora.ckpt")
    capsys.readouterr()

    code = run([*common, f"--trainer.default_root_dir={tmp_path / 'resumed'}", f"--ckpt_path={tmp_path / 'lora.ckpt'}",
                change])  # fmt: skip

    assert code == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    key, new = change[2:].split("=")
    assert error.startswith("error: --ckpt_path continues the checkpoint's model, and this command names another: ")
    assert f"{key} is {4 if 'lora' in key else 32} in the checkpoint, {new} here" in error
    assert not (tmp_path / "resumed").exists() or not any((tmp_path / "resumed").rglob("*.ckpt"))


def test_dynamic_sampling_runs_from_the_command_line(tmp_path):
    """`model.dynamic_sampling` reaches the step as settings, not as the dict the CLI records in `hparams`."""
    cli = main(["fit", "--config", str(TINY_CONFIG), "--model.dynamic_sampling.max_rounds=1",
                f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    assert cli.model.dynamic_sampling.max_rounds == 1 and cli.trainer.global_step == 4
    assert "train/dynamic_rounds" in cli.trainer.logged_metrics


def test_a_stage_that_levels_off_stops_the_fit_with_what_to_change(tmp_path, capsys, caplog):
    """`data.curriculum.plateau_steps` on the tiny model: 4 words is not learned in a few batches (min_steps 50), and
    no rolling reward rises more than plateau_gain 1.0 over its best, so the fit stops 3 GRPO batches after the first,
    long before max_steps, and says how to resume with a shorter length inserted."""
    with caplog.at_level("INFO"):
        cli = main(["fit", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}",
                    "--trainer.logger=false", "--trainer.max_steps=20", "--trainer.limit_val_batches=0",
                    "--trainer.callbacks+=interleave_model.run.callbacks.CurriculumCallback",
                    "--data.curriculum.window=1", "--data.curriculum.plateau_steps=3",
                    "--data.curriculum.plateau_gain=1.0"])  # fmt: skip

    stopped = cli.datamodule.curriculum.state.stopped
    assert cli.trainer.global_step == 2 + 4  # the warm-start's 2 steps, the GRPO batch that set the best, 3 more
    assert stopped.startswith("curriculum: stopping, no gain over 1.0 in the rolling reward at 4 words for 3 batches")
    assert "add `--data.stages '[2, 4, 8]'` to this run's fit command" in stopped
    assert f"warning: {stopped}" in capsys.readouterr().err.splitlines()  # one line on the console
    assert f"curriculum stop: 4 -> 4 words at step 6 ({stopped})" in caplog.text
    assert not (tmp_path / "stages").exists()  # a stage that stopped is not exported as learned


def test_the_installed_console_command_is_the_cli():
    script = shutil.which("interleave-grpo")
    assert script, "`pip install -e .` installs the interleave-grpo command (setup.cfg, console_scripts)"
    done = subprocess.run([script, "fit", "--config", str(TINY_CONFIG), "--print_config"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "name_or_path: tiny" in done.stdout  # model.base.name_or_path
    refused = subprocess.run([script, "validate", "--config", str(TINY_CONFIG), "--ckpt_path=last",
                              "--trainer.default_root_dir=/nonexistent-run-root"], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith("error: ckpt_path last")

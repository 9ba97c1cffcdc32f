"""One folder per run: two runs of a config never touch each other, `--ckpt_path last` continues the newest in place.

The tests share two fits of the tiny config (a named RunLogger and a ModelCheckpoint, as the shipped configs have).
A test that adds to them (a validate run, a resumed fit) states what it expects from what is there when it starts,
so the tests pass in any order and each alone.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from cli import main, run
from interleave_model.run.runs import last_checkpoint
from tests.conftest import TINY_CONFIG

RUN_CONFIG = """
trainer:
  logger: {class_path: interleave_model.run.runs.RunLogger, init_args: {name: tiny}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, save_top_k: 0, every_n_train_steps: 2}
"""


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("checkpoints/*"))}


def _versions(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.iterdir()), key=lambda name: int(name.removeprefix("version_")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two fits of one config under `root`, from a working directory `cwd` that must stay empty."""
    tmp = tmp_path_factory.mktemp("runs")
    config = tmp / "run.yaml"
    config.write_text(RUN_CONFIG)
    root, cwd = tmp / "root", tmp / "cwd"
    cwd.mkdir()

    def args(command: str, *extra: str) -> list[str]:
        return [command, "--config", str(TINY_CONFIG), "--config", str(config), f"--trainer.default_root_dir={root}",
                f"--data.cache_dir={tmp / 'cache'}", *extra]  # fmt: skip

    ended = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        for version in (0, 1):
            cli = main(args("fit"))
            ended[version] = _hashes(Path(cli.trainer.log_dir))
        yield root / "lightning_logs" / "tiny", cwd, args, ended


def test_two_runs_of_one_config_leave_two_intact_run_folders(runs):
    folder, cwd, _, ended = runs
    assert _versions(folder)[:2] == ["version_0", "version_1"]  # a validate run of another test may come after them
    assert _hashes(folder / "version_0") == ended[0]
    for version in (0, 1):
        run_dir = folder / f"version_{version}"
        assert "last.ckpt" in ended[version]
        assert (run_dir / "config.yaml").exists() and (run_dir / "eval" / "report.json").exists()
        assert list(run_dir.glob("events.out.tfevents.*"))
    assert not list(cwd.iterdir())  # default_root_dir moved everything: nothing landed in the working directory


def test_validate_last_evaluates_the_newest_run_in_a_folder_of_its_own(runs, capsys):
    folder, _, args, _ = runs
    newest = folder / "version_1" / "checkpoints" / "last.ckpt"  # the second fit's, resumed in place or not
    step = torch.load(newest, map_location="cpu", weights_only=False)["global_step"]
    run_dir = folder / f"version_{len(_versions(folder))}"
    cli = main(args("validate", "--ckpt_path=last"))

    assert cli.trainer.ckpt_path == str(newest)
    assert Path(cli.trainer.log_dir) == run_dir
    out = capsys.readouterr().out
    assert "validate done: step 0" not in out  # the checkpoint's stage, not an untrained model's
    summary = out[out.index("validate done") :].splitlines()
    assert step >= 4 and summary[1].startswith(f"held-out val at step {step} (alignment score, exact match)")
    assert [line.split()[:2] for line in summary[2:4]] == [["4", "words"], ["8", "words"]]
    assert summary[-3:] == [f"run folder: {run_dir}", f"report: {run_dir / 'eval' / 'report.md'}",
                            f"tensorboard --logdir {folder}"]  # fmt: skip


def test_fit_ckpt_path_last_continues_the_newest_run_in_its_own_folder(runs, capsys):
    folder, cwd, args, ended = runs
    newest = folder / "version_1"
    versions = _versions(folder)  # with or without a validate run of another test
    config = (newest / "config.yaml").read_text()
    with SummaryWriter(newest) as writer:  # what a run killed after its last checkpoint (step 4) had logged
        for step in (5, 6, 7):
            writer.add_scalar("train/loss", 99.0, step)

    cli = main(args("fit", "--ckpt_path=last", "--trainer.max_steps=6"))

    assert cli.trainer.ckpt_path == str(newest / "checkpoints" / "last.ckpt")
    assert Path(cli.trainer.log_dir) == newest and cli.trainer.global_step == 6
    assert _versions(folder) == versions  # no new run
    assert _hashes(folder / "version_0") == ended[0]
    assert (newest / "config.yaml").read_text() == config and (newest / "config-resume-1.yaml").exists()
    events = EventAccumulator(str(newest)).Reload().Scalars("train/loss")
    assert [e.step for e in events] == [3, 4, 5, 6]  # GRPO from step 3; one TensorBoard run goes on after the resume
    assert 99.0 not in [e.value for e in events]  # and what was logged after the checkpoint is dropped

    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out if line.startswith("step ")] == [["step", "6"]]  # one line per evaluation
    summary = out[[line.startswith("fit done") for line in out].index(True) :]
    assert summary[0].startswith("fit done: step 6/6, stage ")
    # the change is measured from the run's first evaluation, at step 2, before the resume
    assert summary[1] == "held-out val at step 6 (alignment score, exact match, change since step 2):"
    assert summary[2].split()[:2] == ["4", "words"] and ("(+" in summary[2] or "(-" in summary[2])
    # GRPO began after the 2 warm-start steps, whose last evaluation (step 2) it is measured from, resume or not
    assert "GRPO added, steps 2-6 (held-out score at step 2, before GRPO -> now):" in summary
    assert not list(cwd.iterdir())


def test_ckpt_path_last_with_no_run_is_a_one_line_error(tmp_path, capsys):
    args = ["validate", "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={tmp_path}", "--ckpt_path=last"]
    assert run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: ckpt_path last: no run under {tmp_path / 'lightning_logs'} has checkpoints/last.ckpt"]


def test_tensorboard_steps_are_the_global_step_across_resumes(tmp_path):
    """Checkpoints saved after each validation, as `data.curriculum.val_threshold` asks: Lightning's own logging step
    gained one at every resume from such a checkpoint (94 against global_step 92 after two resumes)."""
    config = tmp_path / "run.yaml"
    config.write_text(RUN_CONFIG.replace(", every_n_train_steps: 2", ""))  # ModelCheckpoint saves after validation
    args = ["fit", "--config", str(TINY_CONFIG), "--config", str(config), f"--trainer.default_root_dir={tmp_path}",
            f"--data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    main([*args, "--trainer.max_steps=4"])
    for max_steps in (6, 8):
        cli = main([*args, "--ckpt_path=last", f"--trainer.max_steps={max_steps}"])

    assert cli.trainer.global_step == 8 and Path(cli.trainer.log_dir).name == "version_0"  # one run, resumed twice
    events = EventAccumulator(cli.trainer.log_dir).Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in ("train/sft_loss", "train/loss", "val/alignment_4w")}
    # 2 warm-start steps, then GRPO; a validation every 2 steps: each scalar at the global_step it describes
    assert steps == {"train/sft_loss": [1, 2], "train/loss": [3, 4, 5, 6, 7, 8], "val/alignment_4w": [2, 4, 6, 8]}


def test_last_is_the_newest_save_that_loads_requeue_saves_included(tmp_path):
    saved = []

    def save(name: str, step: int, version: int = 0, torn: bool = False) -> Path:
        path = tmp_path / f"version_{version}" / "checkpoints" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": step}, path)
        if torn:  # a kill mid-write without AtomicCheckpointIO: the zip's directory, at its end, is missing
            path.write_bytes(path.read_bytes()[:-100])
        saved.append(path)
        os.utime(path, ns=(len(saved) * 10**9, len(saved) * 10**9))  # one second apart, in the order written
        return path

    save("last.ckpt", 4, version=0)
    requeue = save("hpc_ckpt_1.ckpt", 5, version=0)  # SIGUSR1 after the periodic save
    assert last_checkpoint(tmp_path) == requeue
    newer_run = save("last.ckpt", 2, version=1)
    assert last_checkpoint(tmp_path) == newer_run  # whatever its step
    save("hpc_ckpt_1.ckpt", 3, version=1, torn=True)
    save("epoch=0-step=9.ckpt", 9, version=1)  # what ModelCheckpoint keeps besides last.ckpt is not `last`
    assert last_checkpoint(tmp_path) == newer_run

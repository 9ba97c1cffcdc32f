"""Run folders: every run of a config gets `<root>/lightning_logs/<name>/version_<n>/`, and a resume continues its own.

Everything a run makes (checkpoints, config, samples.log, stages/, eval/, predictions) lives in its version folder,
`trainer.log_dir`: the configs name only the logger's `name` (a `RunLogger`), the CLI fills its `save_dir` from
`trainer.default_root_dir`, and ModelCheckpoint's `dirpath` is left to the logger. Lightning's SLURM requeue save (on
SIGUSR1) goes into the run's `checkpoints/` too. `--ckpt_path last` means the newest of the `last.ckpt` and requeue
saves of the runs of this name (Lightning's own rule, by modification time, applied across the name's runs instead of
one folder), and `fit` from a checkpoint inside a run keeps writing into that run; TensorBoard then drops what the
stopped run logged after that checkpoint, so the curves go on without a fold.

The functions read the parsed CLI config (jsonargparse Namespaces) of one subcommand.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from jsonargparse import Namespace
from lightning.pytorch.loggers import TensorBoardLogger

RUNS_DIR = "lightning_logs"  # Lightning's own folder name under default_root_dir
DEFAULT_LOGGER = "lightning.pytorch.loggers.TensorBoardLogger"  # what Lightning builds for `logger: true`
TENSORBOARD_LOGGERS = (DEFAULT_LOGGER, "lightning.pytorch.loggers.tensorboard.TensorBoardLogger",
                       "interleave_model.run.runs.RunLogger")  # fmt: skip
LAST = "last.ckpt"
REQUEUE = re.compile(r"hpc_ckpt_\d+\.ckpt")  # Lightning's name for the save it makes on SLURM's requeue signal


class RunLogger(TensorBoardLogger):
    """TensorBoardLogger whose `save_dir` may be left out of a config: the CLI sets it from `default_root_dir`.

    Args:
        save_dir: Folder of the runs of every name; None means `<trainer.default_root_dir>/lightning_logs` under the
            CLI, `lightning_logs` otherwise.
        name: The config's name: its runs are `<save_dir>/<name>/version_<n>`.
        version: The run to write into; None means a new one (the CLI sets it when `fit` continues a run).
        kwargs: The rest of TensorBoardLogger's arguments.
    """

    def __init__(
        self, save_dir: str | None = None, name: str = "default", version: int | str | None = None, **kwargs
    ) -> None:
        super().__init__(save_dir or RUNS_DIR, name=name, version=version, **kwargs)


def run_dir(trainer) -> Path:
    """The run's folder: the logger's version folder, or `default_root_dir` without a logger.

    `trainer.log_dir` is a collective under DDP (rank 0 broadcasts it): call this on every rank.
    """
    return Path(trainer.log_dir or trainer.default_root_dir)


class RunError(ValueError):
    """A checkpoint the command line names (`--ckpt_path last`) that no run holds."""


def fill_save_dir(config: Namespace) -> None:
    """Set the logger's `save_dir`, when the config leaves it out, to `<trainer.default_root_dir>/lightning_logs`."""
    for logger in _loggers(config):
        init_args = logger.get("init_args")
        if init_args is not None and "save_dir" in init_args and init_args.save_dir is None:
            init_args.save_dir = str(Path(config.trainer.default_root_dir or ".") / RUNS_DIR)


def runs_root(config: Namespace) -> Path | None:
    """The folder holding this config's runs (`<save_dir>/<name>`), or None when the run has no logger."""
    logger = config.trainer.logger
    if logger is None or logger is True:
        return Path(config.trainer.default_root_dir or ".") / RUNS_DIR
    loggers = _loggers(config)
    if not loggers:
        return None
    init_args = loggers[0].get("init_args") or Namespace()
    if init_args.get("save_dir") is None:
        return None
    return Path(init_args.save_dir) / (init_args.get("name") or "")


def last_checkpoint(root: Path) -> Path | None:
    """The newest `last.ckpt` or requeue save (`hpc_ckpt_<n>.ckpt`) of the runs under `root` that loads; None if none.

    A requeue save holds the steps made since the last periodic `last.ckpt`. A file cut off by a kill mid-write (a
    config without `AtomicCheckpointIO`) does not load and is passed over.
    """
    saves = [path for path in root.glob("version_*/checkpoints/*.ckpt") if _continues(path)]
    newest_first = sorted(saves, key=lambda path: path.stat().st_mtime_ns, reverse=True)
    return next((path for path in newest_first if saved_step(path) is not None), None)


def _continues(path: Path) -> bool:
    """Whether `--ckpt_path last` may continue from this file: a `last.ckpt` or a requeue save."""
    return path.is_file() and (path.name == LAST or REQUEUE.fullmatch(path.name) is not None)


def requeue_save_path(trainer, filepath: str | Path) -> str | Path:
    """Where a checkpoint goes: Lightning's SLURM requeue save into the run's `checkpoints/`, where `last_checkpoint`
    finds it, instead of `default_root_dir`, which the runs of every config share; any other one where it is asked.

    Call it on every rank (`run_dir`), as `Trainer.save_checkpoint` is.
    """
    path = Path(filepath)
    if not trainer.loggers or not REQUEUE.fullmatch(path.name) or path.parent != Path(trainer.default_root_dir):
        return filepath
    return run_dir(trainer) / "checkpoints" / path.name


def run_version(root: Path, checkpoint: Path) -> int | None:
    """The version `n` when `checkpoint` is a checkpoint of the run `root/version_n`, else None."""
    folder = checkpoint.resolve().parent
    if folder.name != "checkpoints" or folder.parent.parent != root.resolve():
        return None
    match = re.fullmatch(r"version_(\d+)", folder.parent.name)
    return int(match.group(1)) if match else None


def place_run(config: Namespace, subcommand: str) -> Path | None:
    """Fill the logger's folder, resolve `ckpt_path: last`, and pin the version a `fit` from a checkpoint continues.

    Returns:
        The run folder a resumed `fit` writes into (None for a new run).

    Raises:
        RunError: `ckpt_path: last` for an evaluation, and no run of this name has a last checkpoint.
    """
    fill_save_dir(config)
    root = runs_root(config)
    ckpt_path = config.get("ckpt_path")
    if root is None or not ckpt_path:
        return None
    if ckpt_path == "last":
        found = last_checkpoint(root)
        if found is None and subcommand != "fit":
            raise RunError(f"ckpt_path last: no run under {root} has checkpoints/{LAST}")
        if found is None:
            return None  # Lightning's own rule: a ModelCheckpoint dirpath, or a new run (with its warning)
        config.ckpt_path = ckpt_path = str(found)
    if subcommand != "fit":
        return None  # an evaluation of a checkpoint is a run of its own
    version = run_version(root, Path(ckpt_path))
    if version is None:
        return None
    _pin_version(config, version, next_logged_step(Path(ckpt_path)))
    return root / f"version_{version}"


def next_logged_step(checkpoint: Path) -> int | None:
    """The first logger step of a resume from `checkpoint`: its `global_step` plus one.

    The module logs every scalar at the trainer's `global_step` (`InterleaveGRPO._log_step`), and what a run logged
    at the checkpoint's own step was logged by the steps the checkpoint holds.
    """
    step = saved_step(checkpoint)
    return step + 1 if step is not None else None


def saved_step(checkpoint: Path) -> int | None:
    """The checkpoint's `global_step`; None when it has none or does not load (torn by a kill mid-write)."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)  # mmap: reads only this much
    except (RuntimeError, EOFError):
        return None
    return state.get("global_step")


def config_filename(run_dir: Path) -> str:
    """`config.yaml` for a new run; a resume keeps it and writes `config-resume-<k>.yaml` beside it."""
    k = 0
    name = "config.yaml"
    while (run_dir / name).exists():
        k += 1
        name = f"config-resume-{k}.yaml"
    return name


def _pin_version(config: Namespace, version: int, purge_step: int | None) -> None:
    """Write into run `version`; TensorBoard drops what the stopped run logged after the checkpoint (`purge_step`)."""
    logger = config.trainer.logger
    if logger is None or logger is True:  # the logger Lightning would build, made explicit to name its version
        init_args = Namespace(save_dir=config.trainer.default_root_dir or ".", name=RUNS_DIR)
        config.trainer.logger = Namespace(class_path=DEFAULT_LOGGER, init_args=init_args)
    entry = _loggers(config)[0]
    entry.init_args.version = version
    if purge_step is not None and entry.class_path in TENSORBOARD_LOGGERS:
        entry.init_args.purge_step = purge_step


def _loggers(config: Namespace) -> list[Namespace]:
    """The logger entries of the config that name a class (not `true`, `false` or None)."""
    logger = config.trainer.logger
    entries = logger if isinstance(logger, list) else [logger]
    return [entry for entry in entries if isinstance(entry, Namespace) and "class_path" in entry]

"""Every command the README's "Everyday commands" and "Your own model" and the configs' comments give runs on this
CPU-only machine: it ends with exit 0, or with exit 2 and one `error:` line that says what to change, never a
traceback.

The commands are read from README.md and configs/*.yaml, so one added there runs here too. They run as a user runs
them, one after the other in one folder (later ones read the runs the earlier ones wrote), with the Llama-3-style
fixture (tests/families.py) for any model folder and `last` for a checkpoint left as `...`. Generic settings appended
to each (steps, pairs, batch sizes, the lengths evaluated) keep them to seconds, whatever the configs set;
a setting the command names itself is left as it is.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("Everyday commands", "Your own model")
MODEL = "/models/X"  # any model folder a command names; the Llama-3-style fixture when it runs
# appended to every `python cli.py ...`: two steps (one warm-start, one GRPO), a handful of pairs, one small batch
CLI_SHORT = ["--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
             "--trainer.limit_test_batches=1", "--trainer.limit_predict_batches=1", "--data.sft_steps=1",
             "--data.train_pairs=8", "--data.val_pairs=2", "--data.test_pairs=2", "--data.eval_stages=[10]",
             "--data.batch_size=1", "--data.sft_batch_size=2", "--data.eval_batch_size=2",
             "--model.sampling.num_generations=2"]  # fmt: skip
GENERATE_SHORT = ["--train-pairs=8", "--val-pairs=2", "--test-pairs=2"]


def documented_commands() -> list[str]:
    """The commands of the README's `SECTIONS`, then of the configs' comments, in order, each once, without comments."""
    readme = (ROOT / "README.md").read_text()
    texts = []
    for section in SECTIONS:
        body = readme.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        texts += re.findall(r"```bash\n(.*?)```", body, flags=re.S)
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        texts.append("\n".join(line[1:] for line in config.read_text().splitlines() if line.startswith("#")))
    found = (re.findall(r"\bpython (?:cli\.py|-m) .*", text.replace("\\\n", " ")) for text in texts)
    commands = (re.sub(r"\s+#.*|\s+", " ", line).strip() for lines in found for line in lines)
    commands = (re.sub(r"/models/\S+|(?<=--model.model_name_or_path )\.\.\.", MODEL, command) for command in commands)
    return list(dict.fromkeys(commands))


def runnable(command: str, model_folder: Path, cache_dir: Path) -> list[str]:
    """The command as it runs here: this interpreter, the fixture for any model folder, short-run settings for what the
    command leaves to its config."""
    argv = shlex.split(command.replace(MODEL, str(model_folder)).replace("--ckpt_path ...", "--ckpt_path last"))
    assert argv[0] == "python", command
    argv[0] = sys.executable
    short = []
    if argv[1] == "cli.py":
        short = [*CLI_SHORT, f"--data.cache_dir={cache_dir}"]
    elif argv[1:4] == ["-m", "interleave_data", "generate"]:
        short = GENERATE_SHORT
    named = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return argv + [setting for setting in short if setting.split("=", 1)[0] not in named]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, family_folders) -> dict[str, subprocess.CompletedProcess]:
    """Each command run once, in order, in a folder holding `cli.py` and `configs/` as a checkout does."""
    folder = tmp_path_factory.mktemp("readme")
    for name in ("cli.py", "configs"):
        (folder / name).symlink_to(ROOT / name)
    # vLLM on a CPU takes the config's gpu_memory_utilization as a share of this machine's memory (7 GiB here for the
    # 3B config); 1 GiB of KV cache holds the fixture's answers
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = {}
    for command in documented_commands():
        argv = runnable(command, family_folders["llama3"], folder / "cache")
        done[command] = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    return done


def test_the_commands_are_found():
    commands = documented_commands()
    assert any("cli.py check" in c for c in commands) and any("cli.py fit" in c for c in commands)


@pytest.mark.slow
@pytest.mark.parametrize("command", documented_commands(), ids=lambda command: command.removeprefix("python "))
def test_a_documented_command_succeeds_or_says_in_one_line_what_to_change(command, outcomes):
    done = outcomes[command]
    output = done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert "Traceback" not in output, output[-3000:]
    assert done.returncode == 0 or (done.returncode == 2 and len(errors) == 1), output[-3000:]

"""Every command the README's "Everyday commands", "Your own model" and "On a GPU" and the configs' comments give (the
installed `interleave-grpo` read as `python cli.py`, the same command) does its job on this CPU-only machine: it ends
with exit 0 and no traceback, unless it is documented as refused on a CPU.

A refusal is documented in the command's own comment, in the words `on a CPU: exit 2, "<words of its error line>"`
(e.g. `# on a CPU: exit 2, "no GPU: run with --trainer.accelerator cpu"`). Such a command must end with exit 2 and
exactly one `error:` line, which holds those words and names the GPU it lacks; a command shown in two places carries
the same comment in both. On a machine with a GPU the refusal does not apply and the command is not run here.

The commands are read from README.md and configs/*.yaml, so one added there runs here too. They run as a user runs
them, one after the other in one folder (later ones read the runs the earlier ones wrote), with the Llama-3-style
fixture (tests/families.py) given Llama-3.2's context length for any model folder, and `last` for a checkpoint left
as `...`. Generic settings appended to each (steps, pairs, batch sizes, the lengths evaluated) keep them to seconds,
whatever the configs set; a setting the command names itself is left as it is. What a command needs that such short
runs never reach (`STAND_INS`) is made just before it, the way the project makes it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from tests.preloaded import Preloaded

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("Everyday commands", "Your own model", "On a GPU")
MODEL = "/models/X"  # any model folder a command names; the Llama-3-style fixture when it runs
# appended to every `python cli.py ...`: two steps (one warm-start, one GRPO), a handful of pairs, small batches, at
# most EVAL_BATCHES of them an evaluation (Lightning's CLI reads a limit of 1 as the float 1.0: every batch), at one
# length (so no milestone is gated on a held-out score: one at a length never evaluated is refused)
EVAL_BATCHES, EVAL_BATCH_SIZE = 2, 2
CLI_SHORT = ["--trainer.max_steps=2", "--trainer.val_check_interval=2", f"--trainer.limit_val_batches={EVAL_BATCHES}",
             f"--trainer.limit_test_batches={EVAL_BATCHES}", f"--trainer.limit_predict_batches={EVAL_BATCHES}",
             "--data.sft_steps=1", "--data.train_pairs=8", "--data.val_pairs=2", "--data.test_pairs=2",
             "--data.eval_stages=[10]", "--data.curriculum.val_threshold=null", "--data.batch_size=1",
             "--data.sft_batch_size=2",
             f"--data.eval_batch_size={EVAL_BATCH_SIZE}", "--model.sampling.num_generations=2"]  # fmt: skip
GENERATE_SHORT = ["--train-pairs=8", "--val-pairs=2", "--test-pairs=2"]
REFUSAL = re.compile(r'on a CPU: exit 2, "([^"]+)"')  # in a command's comment: what its one error line says
# A run's export of a stage it learned (`CurriculumCallback`: the folder `cli.py export` writes), which the two-step
# runs never reach: the same export of that run's last checkpoint stands in for it
STAND_INS = {
    "lightning_logs/curriculum/version_0/stages/50words": "python cli.py export --config configs/curriculum.yaml "
    "--ckpt_path lightning_logs/curriculum/version_0/checkpoints/last.ckpt "
    "--output_dir lightning_logs/curriculum/version_0/stages/50words",
}
LLAMA_3_2_POSITIONS = 131072  # Llama-3.2's max_position_embeddings; the family fixture has 2,048


def documented() -> list[tuple[str, str | None]]:
    """The commands of the README's `SECTIONS`, then of the configs' comments, in order, without comments; each with
    the words of the error line its comment documents on a CPU, or None when it is meant to work."""
    readme = (ROOT / "README.md").read_text()
    texts = []
    for section in SECTIONS:
        body = readme.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        texts += re.findall(r"```bash\n(.*?)```", body, flags=re.S)
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        texts.append("\n".join(line[1:] for line in config.read_text().splitlines() if line.startswith("#")))
    texts = [text.replace("\\\n", " ").replace("interleave-grpo ", "python cli.py ") for text in texts]  # one command
    command = r"\bpython (?:cli\.py|-m|benchmarks/\S+\.py) .*|^hf .*"  # the hub's `hf` as `--help` (`runnable`)
    found = [line for text in texts for line in re.findall(command, text, flags=re.M)]
    commands = []
    for line in found:
        refusal = REFUSAL.search(line)
        command = re.sub(r"\s+#.*|\s+", " ", line).strip()
        command = re.sub(r"/models/\S+|(?<=--model.base.name_or_path )\.\.\.", MODEL, command)
        commands.append((command, refusal and refusal.group(1)))
    return commands


def documented_commands() -> dict[str, str | None]:
    """Each documented command once, in order: the words of its documented refusal on a CPU, or None."""
    return dict(documented())


def runnable(command: str, model_folder: Path, cache_dir: Path) -> list[str]:
    """The command as it runs here: this interpreter, the fixture for any model folder, short-run settings for what the
    command leaves to its config."""
    argv = shlex.split(command.replace(MODEL, str(model_folder)).replace("--ckpt_path ...", "--ckpt_path last"))
    if argv[0] == "hf":  # its subcommand's help: what can be checked of a download or a login offline
        return [*[word for word in argv[:3] if re.fullmatch(r"[a-z]+", word)], "--help"]
    assert argv[0] == "python", command
    argv[0] = sys.executable
    short = []
    if argv[1] == "cli.py":
        short = [*CLI_SHORT, f"--data.cache_dir={cache_dir}"]
    elif argv[1:4] == ["-m", "interleave_data", "generate"]:
        short = GENERATE_SHORT
    named = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return argv + [setting for setting in short if setting.split("=", 1)[0] not in named]


@functools.cache
def runs_named(command: str) -> frozenset[str]:
    """The runs a command writes or reads: its config's logger name, and every `lightning_logs/<name>` it names."""
    names = set(re.findall(r"lightning_logs/([\w.-]+)", command))
    for config in re.findall(r"--config (\S+\.yaml)", command):
        logger = (yaml.safe_load((ROOT / config).read_text()).get("trainer") or {}).get("logger") or {}
        names.add((logger.get("init_args") or {}).get("name") or "")
    return frozenset(names)


@functools.cache
def chains() -> dict[str, str]:
    """Each documented command's chain, named for its runs: commands that write or read a common run are one chain,
    run in order in one folder. Chains share nothing, so each runs in a folder of its own, on whichever test worker
    takes it (`xdist_group`)."""
    groups: list[tuple[frozenset[str], list[str]]] = []  # (run names, commands)
    for command in documented_commands():
        names = runs_named(command)
        joined = [group for group in groups if group[0] & names]
        merged = names.union(*(names for names, _ in joined)), [c for _, cs in joined for c in cs] + [command]
        groups = [group for group in groups if group not in joined] + [merged]
    return {c: "+".join(sorted(names)) or f"alone-{i}" for i, (names, cs) in enumerate(groups) for c in cs}


class Outcomes:
    """Each command's finished process; a command's whole chain runs, in documented order, when the first of its
    commands is asked for."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model, self.done = root, model, {}
        # as a user runs them: vLLM's KV cache takes the config's share of this machine's memory, as docs/MODELS.md says
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        self.env = env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.commands = Preloaded(self.env, root)  # each command a fresh process, the libraries imported once

    def __getitem__(self, command: str) -> subprocess.CompletedProcess:
        if command not in self.done:
            self.run_chain(chains()[command])
        return self.done[command]

    def run_chain(self, chain: str) -> None:
        folder = self.root / chain
        folder.mkdir()
        for name in ("cli.py", "configs", "benchmarks"):
            (folder / name).symlink_to(ROOT / name)
        for command, refusal in documented_commands().items():
            if chains()[command] != chain or (refusal and torch.cuda.is_available()):
                continue
            for path, stand_in in STAND_INS.items():
                if path in command and not (folder / path).exists():
                    made = self.run(stand_in, folder)
                    assert made.returncode == 0, f"{stand_in}\n{made.stderr[-3000:]}"
            self.done[command] = self.run(command, folder)

    def run(self, command: str, folder: Path) -> subprocess.CompletedProcess:
        argv = runnable(command, self.model, folder / "cache")
        if argv[0] == "hf":
            return subprocess.run(argv, cwd=folder, env=self.env, capture_output=True, text=True, timeout=60)
        return self.commands.run(argv, folder, timeout=600)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, family_folders) -> Iterator[Outcomes]:
    """The documented commands' outcomes, each chain run in a folder holding `cli.py` and `configs/` as a checkout
    does."""
    # configs/eval.yaml evaluates up to 500 words, 6,122 tokens with the fixture's small BPE: more than the family
    # fixture's 2,048 positions, well within those of the Llama-3.2 a user names
    model = shutil.copytree(family_folders["llama3"], tmp_path_factory.mktemp("llama-3.2") / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": LLAMA_3_2_POSITIONS}))
    outcomes = Outcomes(tmp_path_factory.mktemp("readme"), model)
    yield outcomes
    outcomes.commands.close()


def test_the_commands_are_found():
    commands = documented_commands()
    assert any("cli.py check" in c for c in commands) and any("cli.py fit" in c for c in commands)
    assert all(any(path in c for c in commands) for path in STAND_INS), "a stand-in no documented command needs"


def test_a_command_shown_twice_is_documented_alike():
    assert len(set(documented())) == len(documented_commands()), sorted(set(documented()))


def test_a_start_from_a_stage_export_skips_the_warm_start():
    """A fit from `<run>/stages/<N>words` starts from trained weights: without `--data.sft_steps 0` it would
    warm-start again from the first stage, which is not what such a command is shown for."""
    starts = [c for c in documented_commands() if re.search(r"--model\.base\.init_from \S*/stages/", c)]
    assert starts and all("--data.sft_steps 0" in c for c in starts), starts


def test_commands_that_share_a_run_run_in_one_chain():
    """Chains split the commands across test workers; a command that reads a run another writes must share its chain
    (and so its folder), or it would find nothing."""
    chain = chains()
    for command in documented_commands():
        for other in documented_commands():
            if runs_named(command) & runs_named(other):
                assert chain[command] == chain[other], (command, other)
    assert (
        chain["python cli.py fit --config configs/demo.yaml"]
        == chain[
            "python -m interleave_model.evaluation.report lightning_logs/eval/version_0 lightning_logs/eval/version_1"
        ]
    )
    assert len(set(chain.values())) >= 4, chain


@pytest.mark.xdist_group("documented-grouping")
def test_a_group_of_tests_stays_on_one_worker(request):
    """`--dist loadgroup` (setup.cfg) keeps each `xdist_group` on one worker by the `@<group>` suffix pytest-xdist gives
    its tests' ids; without it each chain's commands spread over the workers and run twice (the first of its commands
    that a worker meets runs the whole chain). Under pytest 9.2 the suffix no longer takes (pytest-dev/pytest-xdist
    #1386), which the test extra's pin keeps out."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("run without pytest -n and --dist loadgroup")
    assert request.node.nodeid.endswith("@documented-grouping"), (
        f"pytest {pytest.__version__} does not keep xdist groups together: install pytest<9.2"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.xdist_group(f"documented-{chains()[c]}")) for c in documented_commands()],
    ids=lambda c: c.removeprefix("python "),
)
def test_a_documented_command_does_its_job(command, outcomes):
    refusal = documented_commands()[command]
    if refusal and torch.cuda.is_available():
        pytest.skip("documented as refused on a CPU; this machine has a GPU")
    done = outcomes[command]
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-3000:]
    if refusal is None:
        assert done.returncode == 0, output[-3000:]
        evaluated = [int(n) for n in re.findall(r"\((\d+) pairs\)", done.stdout)]  # a held-out score's pairs
        most = EVAL_BATCHES * EVAL_BATCH_SIZE
        assert all(n <= most for n in evaluated), f"the short settings evaluated {evaluated} pairs a length"
        return
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1, output[-3000:]
    assert refusal in errors[0] and "GPU" in errors[0], f"documented: {refusal!r}, said: {errors[0]!r}"

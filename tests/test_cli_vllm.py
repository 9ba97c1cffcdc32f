"""`--model.rollout_engine vllm` through the CLI: fit, validate, predict and resume.

On the GPT-2 fixture: its answers are words, where the random chat families answer blank lines that all read "".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytest.importorskip("vllm")

from cli import main, run  # noqa: E402
from interleave_model.model.policy import load_pretrained  # noqa: E402
from interleave_model.runtime import machine  # noqa: E402
from tests.conftest import TINY_CONFIG  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOGGING_VARIABLES = ("LOGLEVEL", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM")  # not passed on to a user's console
ENGINE = ["--model.rollout_engine=vllm", "--model.vllm.kv_cache_memory_bytes=33554432",
          "--model.vllm.max_model_len=1024", "--model.vllm.enforce_eager=true"]  # fmt: skip


def _args(command: str, root: Path, folder: Path, *extra: str) -> list[str]:
    return [command, "--config", str(TINY_CONFIG), f"--trainer.default_root_dir={root}",
            f"--data.cache_dir={root / 'cache'}", f"--model.base.name_or_path={folder}", "--model.base.dtype=float32",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory, family_folders) -> Path:
    """The GPT-2 fixture with its embeddings scaled down: a sharp random model answers the same whatever a short fit
    did to it, and a missed weight sync could not show."""
    out = tmp_path_factory.mktemp("soft-gpt2")
    model, tokenizer = load_pretrained(str(family_folders["gpt2"]), dtype="float32")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, folder):
    """A 4-step fit (2 warm-start, 2 GRPO) rolled out on vLLM: the CLI, its folder and its checkpoint."""
    root = tmp_path_factory.mktemp("vllm-run")
    torch.set_num_threads(1)
    # a high warm-start rate moves the weights enough to change the greedy answers (and show a missed sync)
    # and the importance-sampling correction runs through grpo_step
    cli = main(_args("fit", root, folder, "--model.optimization.sft_learning_rate=0.05",
                     "--model.vllm.importance_sampling_correction=true", *ENGINE))  # fmt: skip
    (checkpoint,) = root.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    return cli, root, checkpoint


@pytest.mark.slow
def test_fit_rolls_out_on_the_engine_and_logs_its_logprob_gap(fitted):
    cli, _, _ = fitted
    assert cli.trainer.global_step == 4
    events = EventAccumulator(cli.trainer.logger.log_dir).Reload()
    gaps = [event.value for event in events.Scalars("train/engine_logprob_gap")]
    assert len(gaps) == 2 and max(gaps) < 1e-4  # both GRPO steps, engine and trainer in step (fp32)
    assert "val/alignment_4w" in events.Tags()["scalars"]


def _completions(root: Path, folder: Path, *extra: str) -> list[str]:
    cli = main(_args("predict", root, folder, *extra))
    lines = (Path(cli.trainer.log_dir) / "predictions.jsonl").read_text().splitlines()
    return [json.loads(line)["completion"] for line in lines]


@pytest.mark.slow
def test_predict_and_validate_on_the_engine_equal_the_own_sampler(fitted, folder):
    """The checkpoint's weights reach the engine: its greedy answers are the own sampler's, not the folder's."""
    _, root, checkpoint = fitted
    trained = _completions(root, folder, f"--ckpt_path={checkpoint}")
    assert _completions(root, folder, f"--ckpt_path={checkpoint}", *ENGINE) == trained
    assert _completions(root, folder) != trained  # the fit moved the weights far enough to change the answers
    reports = [main(_args("validate", root, folder, f"--ckpt_path={checkpoint}", *extra)).trainer.log_dir
               for extra in ([], ENGINE)]  # fmt: skip
    own, engine = (json.loads((Path(d) / "eval" / "report.json").read_text())["lengths"] for d in reports)
    assert engine == own and len(own) == 2


def test_resume_on_the_engine(fitted, folder, tmp_path):
    _, root, checkpoint = fitted
    copy = shutil.copytree(root, tmp_path / "run")  # the resume goes on in a copy: the shared run stays as fitted
    cli = main(_args("fit", copy, folder, f"--ckpt_path={copy / checkpoint.relative_to(root)}",
                     "--trainer.max_steps=6", *ENGINE))  # fmt: skip
    assert cli.trainer.global_step == 6
    assert Path(cli.trainer.log_dir).is_relative_to(copy)


def _check_args(folder: Path, cache: Path, config: str = "llama-3.2-3b.yaml") -> list[str]:
    """`check` of a 3B config (vLLM, with options a CPU turns off) on `folder`, kept small: the lengths the Llama
    fixture's 2,048 positions hold with its small vocabulary's ~3.5 tokens a word (500 words need 7,454)."""
    return ["check", "--config", str(ROOT / "configs" / config), f"--model.base.name_or_path={folder}",
            "--model.vllm.kv_cache_memory_bytes=33554432", "--data.stages=[10, 25]", "--data.curriculum.threshold=0.9",
            "--data.curriculum.max_stage_steps=null", "--data.eval_stages=[10]",
            "--data.train_pairs=4",
            "--data.val_pairs=2", f"--data.cache_dir={cache}"]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU cannot do: CUDA graphs, bf16")
@pytest.mark.parametrize("config", ["llama-3.2-3b.yaml", "llama-3.2-3b-curriculum.yaml"])
def test_check_of_the_gpu_configs_on_a_cpu_turns_off_what_it_cannot_do(config, family_folders, tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    """A 3B config on a Llama-3-shaped folder on a CPU: no CUDA graphs, the engine's length cut to the model's (the
    Llama fixture has 2,048 positions, the config asks for 4,096), and bf16-mixed precision on a CPU without bf16
    instructions (made so here: the test must not depend on the CPU it runs on), one warning line each; then the
    report. Sleep mode is off in both configs, so nothing is said of it."""
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: False)
    assert run(_check_args(family_folders["llama3"], tmp_path, config)) == 0

    captured = capsys.readouterr()
    warnings = [line.split(":")[1].strip() for line in captured.err.splitlines() if line.startswith("warning:")]
    expected = ["trainer.precision", "model.vllm.enforce_eager", "model.vllm.max_model_len"]
    assert sorted(warnings) == sorted(expected)
    assert "round trip of the target words: ok" in captured.out and "greedy answer:" in captured.out


@pytest.fixture(scope="module")
def narrow_heads(tmp_path_factory, family_folders) -> Path:
    """The Llama fixture with 8 heads of 16 dimensions, which vLLM's CPU attention does not run."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    source, out = family_folders["llama3"], tmp_path_factory.mktemp("llama3-heads-16")
    config = AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.head_dim = 8, 16  # [128 wide] = 8 x 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig.from_pretrained(source)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention")
def test_check_of_a_model_the_engine_cannot_serve_answers_with_the_own_sampler(narrow_heads, tmp_path, capsys,
                                                                              monkeypatch):  # fmt: skip
    """One warning line naming the setting and why, then the report, its greedy answer by the own sampler."""
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: False)  # the precision's warning line, whatever the CPU
    assert run(_check_args(narrow_heads, tmp_path)) == 0

    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "greedy answer:" in captured.out
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert [line.split(":")[1].strip() for line in warnings] == ["trainer.precision", "model.rollout_engine"]
    assert "this model's have 16, so check answers with the own sampler" in warnings[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention")
def test_fit_of_a_model_the_engine_cannot_serve_is_refused_before_any_step(narrow_heads, tmp_path, capsys):
    """A run asked for the engine: one `error:` line saying what to change (exit 2), before the warm-start."""
    assert run(_args("fit", tmp_path, narrow_heads, *ENGINE)) == 2

    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "this model's have 16: run with --model.rollout_engine own" in line


def _console(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python cli.py ARGS` as a user runs it, with none of this session's logging variables; `env` added."""
    inherited = {k: v for k, v in os.environ.items() if k not in LOGGING_VARIABLES}
    env = inherited | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | env
    command = [sys.executable, "cli.py", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _vllm_levels(text: str) -> list[str]:
    """The levels of the lines vLLM's own logger wrote (`(MainProcess pid=26743) WARNING 11-25 17:46:12 [...] ...`)."""
    return [m.group(1) for m in map(re.compile(r"^\(\w+ pid=\d+\) ([A-Z]+) ").match, text.splitlines()) if m]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's start-up messages")
def test_the_engine_says_only_its_errors_unless_loglevel(family_folders, tmp_path):
    """A check answered by vLLM prints the report and the project's warning lines, none of vLLM's messages, warnings
    or progress bars; LOGLEVEL=INFO brings its start-up report back, on stderr with the other libraries'."""
    args = _check_args(family_folders["llama3"], tmp_path)
    quiet = _console(args)
    assert quiet.returncode == 0, quiet.stderr
    assert "greedy answer:" in quiet.stdout and _vllm_levels(quiet.stdout) == []
    others = [line for line in quiet.stderr.splitlines() if not line.startswith("warning: ")]
    # but one: vLLM's C++ extension warns through c10's logging (`[W1125 17:51:44.508 utils.cpp:68] Warning: NUMA
    # binding: ...`), whose level torch reads once, as it loads: Python cannot quiet it. And Lightning's line naming
    # the precision, which a CPU with bf16 instructions keeps (bf16-mixed; elsewhere a `warning:` turns it off)
    lightning = "Using bfloat16 Automatic Mixed Precision (AMP)"
    assert [line for line in others
            if not re.match(r"\[W\d{4} .*Warning: NUMA binding", line) and line != lightning] == []  # fmt: skip

    loud = _console(args, LOGLEVEL="INFO")
    assert loud.returncode == 0, loud.stderr
    assert _vllm_levels(loud.stdout) == [] and "INFO" in _vllm_levels(loud.stderr)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="two CPU ranks (gloo)")
def test_two_ranks_fit_on_their_own_engines_and_exit_clean(family_folders, tmp_path):
    """configs/llama-3.2-3b.yaml under DDP on two CPU processes, each rank with its colocated engine (vLLM's
    `external_launcher`, which reads RANK and LOCAL_RANK: Lightning's launcher does not export them all), LoRA served;
    each engine shuts down before the process group does, so no rank prints a traceback at exit."""
    command = [
        sys.executable, "cli.py", "fit", "--config", str(ROOT / "configs" / "llama-3.2-3b.yaml"),
        f"--model.base.name_or_path={family_folders['llama3']}", "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--trainer.strategy=ddp", "--trainer.precision=32-true", "--model.base.dtype=float32", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", f"--trainer.default_root_dir={tmp_path}", f"--data.cache_dir={tmp_path}",
        "--data.train_pairs=8", "--data.val_pairs=2", "--data.eval_stages=[10]", "--data.batch_size=1",
        "--model.sampling.num_generations=2", "--trainer.logger=false", "--trainer.callbacks=null", *ENGINE,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(command, cwd=ROOT, env=env | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "fit done: step 2/2" in done.stdout

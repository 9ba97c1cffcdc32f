"""`cli.py check`: each problem one `error:` line and exit 2; `check --rehearse`: the config's fit on a small random
model of the folder's family, every stage, a resume and an export, on the configured engine."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from cli import bare_flags, run
from interleave_model.preflight.checks import text_lines
from interleave_model.preflight.estimates import MEASURED_STEPS, estimate_lines, shape, step_memory, step_time
from interleave_model.preflight.rehearsal import shrink
from interleave_model.runtime import machine

ROOT = Path(__file__).resolve().parent.parent
CURRICULUM_3B = str(ROOT / "configs" / "llama-3.2-3b-curriculum.yaml")


@pytest.fixture(scope="module")
def llama32(tmp_path_factory, family_folders) -> Path:
    """The Llama-3 fixture with Llama-3.2's 131,072 positions, so a config's own `max_model_len` is the limit."""
    folder = tmp_path_factory.mktemp("llama32")
    shrink(str(family_folders["llama3"]), folder)
    config = AutoConfig.from_pretrained(folder)
    config.max_position_embeddings = 131072
    config.save_pretrained(folder)
    return folder


def test_a_shrunk_folder_keeps_the_family_and_its_tokenizer(family, tmp_path):
    name, source = family
    out = shrink(str(source), tmp_path / "small")
    config, original = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(source)
    assert config.model_type == original.model_type and config.vocab_size == original.vocab_size
    assert (config.num_hidden_layers, config.hidden_size) == (2, 128)
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
    tokenizer, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
    assert tokenizer.chat_template == theirs.chat_template and tokenizer("a b c") == theirs("a b c")
    assert (out / "generation_config.json").read_text() == (source / "generation_config.json").read_text()


def test_the_memory_estimate_gives_scaling_md_table_for_the_3b_shape():
    """Llama-3.2-3B's config (no weights) at SCALING's 500-word token counts: its table, figure by figure."""
    config = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True)  # fmt: skip
    model = shape(config, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16)
    assert (model.parameters, model.lora_parameters, model.kv_per_token) == (3_212_749_824, 24_313_856, 112 * 1024)
    engine = step_memory(model, 1490, 1693, prompts=4, generations=16, micro_batch=16, weight_bytes=2,
                         engine_share_gib=24.0)  # fmt: skip
    assert round(engine.weights, 2) == 5.98 and round(engine.adapter, 2) == 0.36
    assert round(engine.rollout_kv, 1) == 12.2 and engine.waves() == 1  # 16 GiB of cache room in 24
    assert engine.update == pytest.approx(8.16 + 6.93 + 0.5, rel=0.01) and round(engine.trainer_peak) == 22
    own = step_memory(model, 1490, 1693, 4, 16, 16, 2, None)
    assert round(own.rollout_kv, 1) == 21.8 and round(own.trainer_peak) == 28
    assert step_memory(model, 2443, 2885, 4, 16, 16, 2, 24.0).waves() == 2  # the measured 500-word rows
    assert shape(config, "all-linear", 16).lora_parameters == model.lora_parameters  # peft's reading: no output layer


def test_the_estimate_lines_read_the_config_as_the_run_does():
    """No micro-batch means every row at once (4 x 16), no vLLM share means the own sampler, no LoRA no adapter."""
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, vocab_size=1024)  # fmt: skip
    run = {"model": {"base": {"dtype": "bfloat16"}, "lora": None, "rollout_engine": "own",
                     "sampling": {"num_generations": 16}, "optimization": {"micro_batch_size": None}},
           "data": {"batch_size": 4}}  # fmt: skip
    (head, line, time_head, time_line) = estimate_lines(run, {500: (10000, 5000)}, config, 80.0, "a test GPU")
    expected = step_memory(shape(config, None, 0), 10000, 5000, 4, 16, 64, 2, None)
    assert expected.update > step_memory(shape(config, None, 0), 10000, 5000, 4, 16, 16, 2, None).update + 0.1
    assert head.endswith("on a test GPU, 80.0 GiB, the update through the fused LM head: one fp32 tile:")
    assert "adapter 0.00" in line
    assert f"update {expected.update:.1f}" in line and f"rollout KV {expected.rollout_kv:.1f})" in line
    took = step_time(shape(config, None, 0), 5000, rows=64)  # every row of the batch is answered and updated
    assert (
        "64 answers" in time_head
        and time_line == f"  500 words: {took.step:.0f} s (rollout {took.rollout:.0f} s, update {took.rest:.0f} s)"
    )


def test_a_family_without_the_fused_head_is_estimated_with_its_full_logits(family_folders):
    """Gemma at Llama-3.2-3B's shape and SCALING's 500-word tokens: the update holds 16 rows x 1,693 answer tokens x
    128,256 logits in bf16, their fp32 copy and its gradient (2 + 4 + 4 bytes: SCALING's 32.4 GiB) where the fused
    head holds one 0.5 GiB tile; the line says which path. GPT-2's fixture folder takes the full logits too."""
    from transformers import GemmaConfig

    dims = {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256}  # fmt: skip
    llama, gemma = shape(LlamaConfig(**dims), None, 0), shape(GemmaConfig(**dims), None, 0)
    fused, full = (step_memory(m, 1490, 1693, 4, 16, 16, 2, None) for m in (llama, gemma))
    assert llama.fused_head and not gemma.fused_head
    assert full.update - fused.update == pytest.approx(16 * 1693 * 128256 * 10 / 2**30 - 0.5)
    assert round(full.update - fused.update + 0.5, 1) == 32.4 and full.trainer_peak > fused.trainer_peak + 20
    run = {"model": {"base": {"dtype": "bfloat16"}, "lora": None, "rollout_engine": "own",
                     "sampling": {"num_generations": 16}, "optimization": {"micro_batch_size": 16}},
           "data": {"batch_size": 4}}  # fmt: skip
    head, line, *_ = estimate_lines(run, {500: (1490, 1693)}, GemmaConfig(**dims), 80.0, "a test GPU")
    assert "full logits: gemma has no fused LM head" in head and f"update {full.update:.1f}" in line
    gpt2 = AutoConfig.from_pretrained(family_folders["gpt2"])
    assert "full logits: gpt2 has no fused LM head" in estimate_lines(run, {10: (40, 30)}, gpt2, 80.0, "a GPU")[0]


def test_the_time_estimate_meets_the_measured_steps_and_gives_scaling_md_table():
    """At the measured budgets, the measured 3B steps; at the curriculum's budgets, SCALING's table, stage by stage."""
    config = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True)  # fmt: skip
    model = shape(config, None, 0)
    for budget, rollout, step in MEASURED_STEPS:
        took = step_time(model, budget, rows=64)
        assert took.rollout == pytest.approx(rollout) and took.step == pytest.approx(step)
    # docs/SCALING.md, "Expected time of the curriculum on one GPU": budget, rollout, update, step (seconds)
    table = {10: (58, 3, 3, 6), 25: (144, 9, 4, 13), 50: (289, 20, 6, 26), 100: (577, 32, 14, 46),
             200: (1154, 65, 27, 92), 500: (2885, 162, 69, 231)}  # fmt: skip
    for budget, rollout, update, step in table.values():
        took = step_time(model, budget, rows=64)
        assert (round(took.rollout), round(took.rest), round(took.step)) == (rollout, update, step)
    # beyond the longest measured step, the rest is in proportion to the row-tokens
    half = step_time(model._replace(parameters=model.parameters // 2), 2885, rows=32)
    assert half.rollout == pytest.approx(step_time(model, 2885, 64).rollout / 2, rel=1e-6)  # half the weights to read
    assert half.rest == pytest.approx(step_time(model, 2885, 64).rest / 4, rel=1e-6)  # half the rows, half the weights


def test_a_bare_flag_takes_true_and_a_valued_one_is_kept():
    assert bare_flags(["check", "--rehearse"]) == ["check", "--rehearse=true"]
    assert bare_flags(["check", "--rehearse", "--config", "c"]) == ["check", "--rehearse=true", "--config", "c"]
    assert bare_flags(["check", "--rehearse", "false"]) == ["check", "--rehearse", "false"]


def test_texts_per_split_warn_below_ten_and_fail_below_two():
    def examples(n, split):
        texts = {"train": 20, "val": 1 if n == 500 else 4, "test": 5}[split]
        return [SimpleNamespace(text_a=f"{split}{i}", text_b=f"{split}{i + 1}") for i in range(texts)]

    lines, problems = text_lines(SimpleNamespace(examples=examples), [10, 500])
    assert "10 words: texts train 21, val 5, test 6" in lines
    assert [line for line in lines if "FAIL" in line] == [] and problems == []  # 1 pair holds 2 texts
    one, [problem] = text_lines(SimpleNamespace(examples=lambda n, split: [SimpleNamespace(text_a="x", text_b="x")]),
                                [500])  # fmt: skip
    assert one[1].startswith("500 words: FAIL its validation pairs come from 1 text, fewer than 2")
    assert problem.startswith("500 words: its validation pairs come from 1 text, fewer than 2")
    assert one[2].startswith("warning: the 500-word val pairs come from 1 texts")
    assert sum(line.startswith("warning:") for line in lines) == 2  # 5 and 2 validation texts, both under 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's run of the GPU configs")
def test_check_with_a_short_max_model_len_exits_2_with_a_line_per_stage(llama32, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: False)
    code = run(["check", "--config", CURRICULUM_3B, f"--model.base.name_or_path={llama32}",
                "--model.vllm.max_model_len=1024", "--data.train_pairs=4", "--data.val_pairs=2",
                f"--data.cache_dir={tmp_path}"])  # fmt: skip

    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) >= 2 and all("more than model.vllm.max_model_len of 1024" in line for line in errors)
    assert errors[-1].startswith("error: 500 words: the 500-word stage needs")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's run of the GPU configs")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_3b_curriculum_rehearses_its_stages_on_the_engine_a_resume_and_an_export(llama32, tmp_path, capsys,
                                                                                   monkeypatch):  # fmt: skip
    """The curriculum config's first two stages (its 500-word stage samples ~4,000 tokens an answer with the fixture's
    small vocabulary: minutes on 2 cores); `configs/llama-3.2-3b.yaml` is rehearsed whole by the command in
    docs/MODELS.md (tests/test_documented_commands.py)."""
    pytest.importorskip("vllm")
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: False)
    monkeypatch.chdir(tmp_path)
    code = run(["check", "--config", CURRICULUM_3B, f"--model.base.name_or_path={llama32}", "--rehearse",
                "--data.stages=[10, 25]", "--data.curriculum.threshold=0.9", "--data.curriculum.max_stage_steps=null",
                "--data.train_pairs=4", "--data.val_pairs=2",
                f"--data.cache_dir={tmp_path}"])  # fmt: skip

    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert "rehearsal: 10 words: " in out and "rehearsal: 25 words: " in out
    assert "at 25 words, resumed" in out and "held-out evaluation at 10, 25 words: ok" in out and "exported to" in out
    assert "estimate (not measured; docs/SCALING.md's model) for the real model on" in out
    assert re.search(r"  25 words: trainer [\d.]+ GiB .*; vLLM [\d.]+ GiB, KV [\d.]+ of [\d.]+ GiB: at once", out)
    assert "of a step's time, the own sampler, 64 answers each running to its budget:" in out  # 4 prompts x 16
    assert re.search(r"\n  25 words: \d+ s \(rollout \d+ s, update \d+ s\)\n", out)
    assert not list(tmp_path.glob("lightning_logs")), "the rehearsal writes only in its own temporary folder"

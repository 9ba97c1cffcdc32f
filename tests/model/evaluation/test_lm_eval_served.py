"""SmolLM2 measured three ways gives each pair `cli.py test`'s score: lm-eval's hf backend, and vLLM's OpenAI-compatible
server (its CPU build) through `served.py`'s chat and completions APIs, with a key that only the environment holds and
no output shows. A server that refuses, does not answer or refuses the key is one `error:` line, exit status 2. The
200- and 500-word prompts reach the server whole, within its context length; a task that cannot fit is refused."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import requests

from interleave_data.prompts import adds_special_tokens, format_prompt
from interleave_model.evaluation import served
from interleave_model.evaluation.lm_eval_tasks.documents import load
from interleave_model.evaluation.report import load_report
from interleave_model.generation.rollout import answer_budget
from interleave_model.model import shipped
from tests.model.evaluation.test_lm_eval_tasks import EVAL_CONFIG, PAIRS, assert_agree, lm_eval_samples, project_records

NAME = "smollm2-135m-instruct"
SERVED_NAME = "smollm2"


@pytest.fixture(scope="module")
def folder() -> Path:
    folder = shipped.cache_root() / "models" / NAME
    if not (folder / "config.json").is_file():
        pytest.fail(f"the real model is not built: run `python -m interleave_model.model.shipped {NAME}`")
    return folder


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict[str, dict]:
    """`cli.py predict` on the first test pairs of 10 words: each pair's answer and scores, by id."""
    args = ["--config", str(EVAL_CONFIG), f"--model.base.name_or_path={NAME}", "--model.base.dtype=float32"]
    return project_records(args, tmp_path_factory.mktemp("ours"))


@pytest.mark.slow
def test_the_hf_backend_scores_the_same(folder, ours):
    assert_agree(ours, lm_eval_samples(folder, chat=True, template="two_processes"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """vLLM's OpenAI-compatible server of SmolLM2 on a free local port, behind a key; shut down after the module.

    It holds SmolLM2's whole context (8,192 tokens: a 500-word prompt and its budget fit) and answers with at most the
    10-word budget: the 10-word answers are whole, and a longer length's answer costs no more than they do.
    """
    pytest.importorskip("vllm")
    port, key = _free_port(), f"key-{secrets.token_hex(8)}"
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "8192", "--enforce-eager", "--api-key", key,
               "--override-generation-config", json.dumps({"max_new_tokens": answer_budget(10)})]  # fmt: skip
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer in 600 s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url, key
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _served(url: str, *extra: str, tasks: Sequence[str] = ("interleave_10w",), pairs: int = PAIRS) -> list[str]:
    return ["--base_url", url, "--model", SERVED_NAME, "--tasks", *tasks, "--timeout", "120",
            "--metadata", json.dumps({"test_pairs": pairs}), *extra]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_the_served_model_scores_the_same_and_the_key_shows_nowhere(
    server, api, ours, folder, tmp_path, monkeypatch, capsys, caplog
):
    url, key = server
    monkeypatch.setenv(served.KEY_VARIABLE, key)
    extra = ["--api", api, "--output_path", str(tmp_path / "out")]
    extra += ["--tokenizer", str(folder)] if api == "completions" else []

    assert served.main(_served(url, *extra)) == 0

    (samples,) = (tmp_path / "out").rglob("samples_interleave_10w_*.jsonl")
    assert_agree(ours, {s["doc"]["id"]: s for s in map(json.loads, samples.read_text().splitlines())})
    (row,) = load_report(tmp_path / "out")["lengths"]  # the comparison reads the served model's results
    assert (row["n_words"], row["pairs"]) == (10, PAIRS)
    assert row["score"] == pytest.approx(sum(record["score"] for record in ours.values()) / PAIRS)
    printed = capsys.readouterr()
    written = "".join(path.read_text() for path in (tmp_path / "out").rglob("*") if path.is_file())
    assert "alignment" in printed.out and "interleave_10w" in written
    assert all(key not in text for text in (printed.out, printed.err, caplog.text, written))


@pytest.mark.slow
def test_a_wrong_key_is_one_line(server, monkeypatch, capsys):
    url, _ = server
    monkeypatch.setenv(served.KEY_VARIABLE, "not-the-key")
    assert served.main(_served(url)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "refused the key in OPENAI_API_KEY (HTTP 401)" in err and "\n" not in err


@pytest.fixture
def payloads(monkeypatch) -> list[dict]:
    """What lm-eval's completions API sends the server, one payload a request (its `prompt` the token ids)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    sent, create = [], LocalCompletionsAPI._create_payload

    def recording(self, *args, **kwargs) -> dict:
        sent.append(create(self, *args, **kwargs))
        return sent[-1]

    monkeypatch.setattr(LocalCompletionsAPI, "_create_payload", recording)
    return sent


@pytest.mark.slow
def test_long_prompts_reach_the_server_whole(server, folder, payloads, monkeypatch):
    """Under lm-eval's default max_length (2048) a budget of 2,000 tokens would leave 47 of each prompt; `served.py`
    passes the server's 8,192, and `--gen_kwargs` sets the budget lm-eval asks for."""
    url, key = server
    monkeypatch.setenv(served.KEY_VARIABLE, key)
    tasks = ("interleave_200w", "interleave_500w")
    extra = ["--api", "completions", "--tokenizer", str(folder), "--limit", "1", "--gen_kwargs", "max_gen_toks=2000"]

    assert served.main(_served(url, *extra, tasks=tasks, pairs=1)) == 0

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for n in (200, 500):
        (doc,) = load(n, test_pairs=1)["test"]
        text = format_prompt(doc["a"], doc["b"], "two_processes", tokenizer)  # the chat header, instruction, fragments
        prompts.append(tokenizer(text, add_special_tokens=adds_special_tokens(tokenizer)).input_ids)
    assert sorted((ids for payload in payloads for ids in payload["prompt"]), key=len) == prompts
    assert [payload["max_tokens"] for payload in payloads] == [2000, 2000]


def _stand_in(monkeypatch, max_model_len: int | None) -> dict:
    """A server that says `max_model_len`, and an lm-eval that records what it was given and evaluates nothing."""
    import lm_eval

    given = {}

    def simple_evaluate(**kwargs) -> dict:
        given.update(kwargs)
        return {"results": {}}

    monkeypatch.setattr(served, "probe", lambda base_url, model, timeout: max_model_len)
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    return given


def test_the_server_limit_and_gen_kwargs_reach_lm_eval(folder, monkeypatch):
    given = _stand_in(monkeypatch, 8192)
    extra = ["--api", "completions", "--tokenizer", str(folder), "--gen_kwargs", "max_gen_toks=64,temperature=0"]

    assert served.main(_served("http://server/v1", *extra, tasks=["interleave_500w"], pairs=1)) == 0

    assert given["model"] == "local-completions" and given["model_args"]["max_length"] == 8192
    assert given["gen_kwargs"] == {"max_gen_toks": 64, "temperature": 0}


@pytest.mark.parametrize(
    ("api", "max_length", "whose"),
    [("completions", "4096", "--max_length"), ("chat", None, "the server's max_model_len")],
)
def test_a_task_that_cannot_fit_is_one_line(api, max_length, whose, folder, monkeypatch, capsys):
    """The 500-word prompt and its budget of 3,008 tokens need more than 4,096: nothing is sent."""
    given = _stand_in(monkeypatch, 8192 if max_length else 4096)
    extra = ["--api", api, "--tokenizer", str(folder), *(["--max_length", max_length] if max_length else [])]

    assert served.main(_served("http://server/v1", *extra, tasks=["interleave_200w", "interleave_500w"], pairs=1)) == 2

    err = capsys.readouterr().err.strip()
    assert err.startswith("error: interleave_500w: a prompt of ") and "\n" not in err
    assert "an answer budget of 3,008 (max_gen_toks) need " in err and f"more than {whose} (4,096)" in err
    assert not given


def test_a_completions_server_of_unknown_length_is_one_line(folder, monkeypatch, capsys):
    given = _stand_in(monkeypatch, None)  # SmolLM2's tokenizer states no model_max_length either

    assert served.main(_served("http://server/v1", "--api", "completions", "--tokenizer", str(folder))) == 2

    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and err.endswith("pass --max_length") and "\n" not in err
    assert not given


def test_a_refused_connection_is_one_line(capsys):
    assert served.main(_served(f"http://127.0.0.1:{_free_port()}/v1")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "connection refused" in err and "\n" not in err


def test_a_server_that_does_not_answer_is_one_line(capsys):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        assert served.main([*_served(url), "--timeout", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no answer within 1 s" in err and "\n" not in err

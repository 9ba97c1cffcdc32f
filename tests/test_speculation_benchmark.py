"""benchmarks/speculation.py on a model folder of a real family's conventions: the greedy-answer drafts, which the
model keeps whole (the most speculation can give), and the refusal of that source when sampling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "speculation.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_greedy_drafts_are_kept_whole_and_target_drafts_are_not(family_folders):
    model = str(family_folders["llama3"])  # random weights: they do not interleave
    common = ("--model", model, "--template", "compact", "--words", "6", "--prompts", "2", "--generations", "2",
              "--repeats", "1", "--temperature", "0")  # fmt: skip
    lines = {}
    for source, copy in (("greedy", "float32"), ("target", None)):  # the ceiling sampled as training rollouts are
        done = _run(*common, "--draft-source", source, *(["--merged-copy", copy] if copy else []))
        assert done.returncode == 0, done.stderr[-3000:]
        line = json.loads(done.stdout.splitlines()[-1])
        assert line["merged_copy"] == copy
        (lines[source],) = line["lengths"]
    ceiling, target = lines["greedy"], lines["target"]
    assert ceiling["greedy_equal"] and target["greedy_equal"]
    assert ceiling["kept_share"] == 1.0 and ceiling["tokens_per_forward"] > 3.0  # of at most 5 with 4 drafted
    assert ceiling["forwards"] < ceiling["plain_steps"] / 2
    assert target["kept_share"] < 0.5 and target["tokens_per_forward"] < ceiling["tokens_per_forward"]
    assert ceiling["completion_tokens"][0] == ceiling["completion_tokens"][1] == target["completion_tokens"][0]


def test_greedy_drafts_refuse_sampling_in_one_line():
    done = _run("--model", "unread", "--draft-source", "greedy", "--temperature", "1.0")  # refused before loading
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("error: --draft-source greedy drafts greedy answers: give --temperature 0, with the own "
                         "engine")  # fmt: skip

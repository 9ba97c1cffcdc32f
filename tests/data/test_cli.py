import json
import subprocess
import sys

import pytest

from interleave_data import folder
from interleave_data.cli import main
from interleave_data.corpus import load_corpus
from interleave_data.folder import read_split
from tests.data.helpers import numbered_texts, write_jsonl

REQUIRED = {"id", "n_words", "a", "b", "target", "text_a", "text_b", "split"}
SMALL = ["--stages", "5", "20", "--train-pairs", "12", "--val-pairs", "3", "--test-pairs", "2"]


@pytest.fixture
def corpus_file(tmp_path):
    return write_jsonl(tmp_path / "texts.jsonl", numbered_texts(30, 20))  # 30 texts of 20-49 words


def _generate(out, *extra, corpus=None):
    return main(["generate", "--output-dir", str(out), *SMALL, *(["--corpus", corpus] if corpus else []), *extra])


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_stats_prints_a_row_per_stage(capsys, corpus_file):
    assert main(["stats", "--corpus", corpus_file, "--stages", "10", "40", "45"]) == 0

    out = capsys.readouterr().out
    corpus = load_corpus([corpus_file])
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.split()[0].isdigit()}
    assert sorted(rows) == [10, 40, 45]
    for n, row in rows.items():
        assert int(row[1]) == corpus.count_at_least(n)
        assert sum(map(int, row[2:5])) == corpus.count_at_least(n)  # each usable text is in exactly one split
    assert "texts: 30 (dropped 0 empty, 0 duplicate)" in out


def test_stats_warns_when_a_stage_is_longer_than_the_texts(capsys, corpus_file):
    assert main(["stats", "--corpus", corpus_file, "--stages", "10", "1000"]) == 0

    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert warnings and all("stage 1000 words" in line and "--corpus" in line for line in warnings)


def test_generate_writes_every_stage_and_split(tmp_path, capsys, corpus_file):
    out = tmp_path / "ds"

    assert _generate(out, corpus=corpus_file) == 0

    assert sorted(_files(out)) == sorted(
        [f"{n}words/{split}.jsonl" for n in (5, 20) for split in ("train", "val", "test")] + ["stats.json"]
    )
    for n in (5, 20):
        for split, count in (("train", 12), ("val", 3), ("test", 2)):
            lines = (out / f"{n}words" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
            rows = [json.loads(line) for line in lines]
            assert len(rows) == count
            assert all(REQUIRED <= row.keys() and row["n_words"] == n and row["split"] == split for row in rows)
            assert all(list(row) == sorted(row) for row in rows)
    stats = json.loads((out / "stats.json").read_text())
    assert [s["pairs"] for s in stats["stages"]] == [{"train": 12, "val": 3, "test": 2}] * 2
    table = capsys.readouterr().out.splitlines()[-2:]
    assert [row.split()[:4] for row in table] == [["5", "12", "3", "2"], ["20", "12", "3", "2"]]


def test_unicode_words_are_written_unescaped(tmp_path):
    words = ["naïve", "café", "東京", "😀", "Ωmega"]
    texts = [" ".join(f"{w}{i}{j}" for j in range(12) for w in words) for i in range(20)]
    corpus = write_jsonl(tmp_path / "u.jsonl", texts)

    assert _generate(tmp_path / "ds", corpus=corpus) == 0

    raw = (tmp_path / "ds" / "20words" / "train.jsonl").read_text(encoding="utf-8")
    assert "\\u" not in raw and all(w in raw for w in words)


def test_generate_is_byte_identical_per_seed(tmp_path, corpus_file):
    for name, seed in (("a", "4"), ("b", "4"), ("c", "5")):
        assert _generate(tmp_path / name, "--seed", seed, corpus=corpus_file) == 0

    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    differing = [p for p, data in _files(tmp_path / "a").items() if _files(tmp_path / "c")[p] != data]
    assert any(p.endswith("train.jsonl") for p in differing)


def test_default_corpus_reaches_every_default_stage(tmp_path):
    args = ["generate", "--output-dir", str(tmp_path / "ds"), "--train-pairs", "2", "--val-pairs", "2"]

    assert main([*args, "--test-pairs", "2"]) == 0
    assert len(read_split(tmp_path / "ds", 500, "test")) == 2


def test_non_empty_output_dir_is_refused_unless_overwrite(tmp_path, capsys, corpus_file):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "keep.txt").write_text("precious")

    assert _generate(out, corpus=corpus_file) == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").exists()

    assert _generate(out, "--overwrite", corpus=corpus_file) == 0
    assert not (out / "keep.txt").exists() and (out / "stats.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "texts.jsonl"]  # no staging folders left behind


def test_a_failure_while_writing_leaves_the_old_folder_intact(tmp_path, monkeypatch, corpus_file):
    out = tmp_path / "ds"
    assert _generate(out, corpus=corpus_file) == 0
    before = _files(out)
    calls = []

    def failing_line(row):
        calls.append(row)
        if len(calls) > 5:
            raise OSError("disk full")
        return json.dumps(row) + "\n"

    monkeypatch.setattr(folder, "_json_line", failing_line)

    assert _generate(out, "--overwrite", "--seed", "9", corpus=corpus_file) == 2
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "texts.jsonl"]


def _bad_inputs(tmp_path):
    """``(argv, text the one-line error must contain)`` for each kind of bad input."""
    (tmp_path / "bad.jsonl").write_text('{"text": "a b c"}\n{"text": "d e f"\n')
    (tmp_path / "notext.jsonl").write_text('{"text": "a b c"}\n{"title": "x"}\n')
    (tmp_path / "bad.json").write_text('{"a": "b",}')
    (tmp_path / "latin1.txt").write_bytes("déjà".encode("latin-1"))
    (tmp_path / "empty.json").write_text("[]")
    short = write_jsonl(tmp_path / "short.jsonl", numbered_texts(10, 5))
    return [
        (["--corpus", str(tmp_path / "missing.json")], "missing.json: no such file or directory"),
        (["--corpus", str(tmp_path / "bad.jsonl")], "bad.jsonl:2: invalid JSON"),
        (["--corpus", str(tmp_path / "notext.jsonl")], "notext.jsonl:2: object has no 'text' field"),
        (["--corpus", str(tmp_path / "bad.json")], "bad.json:1: invalid JSON"),
        (["--corpus", str(tmp_path / "latin1.txt")], "latin1.txt: not UTF-8"),
        (["--corpus", str(tmp_path / "empty.json")], "empty corpus"),
        (["--corpus", short, "--stages", "5", "100"], "stage 100 words"),
        (["--stages", "0"], "argument --stages: must be a positive integer, got '0'"),
        (["--stages", "2.5"], "argument --stages: must be a positive integer, got '2.5'"),
        (["--stages", "-3"], "must be a positive integer, got '-3'"),
        (["--stages", "25", "10"], "--stages must be strictly increasing"),
        (["--train-pairs", "x"], "argument --train-pairs: must be a non-negative integer"),
        (["--split-fractions", "0.5", "0.5", "0.5"], "split fractions"),
    ]


def test_every_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    for extra, expected in _bad_inputs(tmp_path):
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as info:
            sys.exit(main(["generate", "--output-dir", str(out), *extra]))
        err = capsys.readouterr().err
        assert info.value.code == 2, extra
        assert expected in err and err.count("\n") == 1, (extra, err)
        assert not out.exists()


def test_module_entry_point_exits_2_without_traceback(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "interleave_data", "stats", "--corpus", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        check=False,
    )

    assert run.returncode == 2
    assert run.stderr.strip() == f"interleave_data: error: {tmp_path / 'nope.jsonl'}: no such file or directory"

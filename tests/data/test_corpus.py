import json
import re

import datasets
import pytest

from interleave_data.corpus import CorpusError, corpus_fingerprint, default_topics, load_corpus

TEXTS = ["alpha beta, gamma.", "delta  epsilon\n\tzeta eta"]


def _write(tmp_path, fmt: str) -> str:
    """Writes TEXTS in one source format and returns the source string."""
    if fmt == "json-strings":
        (tmp_path / "c.json").write_text(json.dumps(TEXTS))
        return str(tmp_path / "c.json")
    if fmt == "json-objects":
        (tmp_path / "c.json").write_text(json.dumps([{"text": t, "title": str(i)} for i, t in enumerate(TEXTS)]))
        return str(tmp_path / "c.json")
    if fmt == "json-mapping":
        (tmp_path / "c.json").write_text(json.dumps({f"name{i}": t for i, t in enumerate(TEXTS)}))
        return str(tmp_path / "c.json")
    if fmt == "jsonl":
        (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n\n")
        return str(tmp_path / "c.jsonl")
    if fmt == "txt-folder":
        (tmp_path / "txts" / "sub").mkdir(parents=True)
        (tmp_path / "txts" / "one.txt").write_text(TEXTS[0])
        (tmp_path / "txts" / "sub" / "two.txt").write_text(TEXTS[1])
        (tmp_path / "txts" / "notes.md").write_text("not a text of the corpus")
        return str(tmp_path / "txts")
    if fmt == "hf-dataset":
        datasets.Dataset.from_dict({"text": TEXTS, "other": [1, 2]}).save_to_disk(str(tmp_path / "hf"))
        return str(tmp_path / "hf")
    if fmt == "hf-dataset-dict":
        splits = {
            "train": datasets.Dataset.from_dict({"text": TEXTS[:1]}),
            "test": datasets.Dataset.from_dict({"text": TEXTS[1:]}),
        }
        datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "hfd"))
        return str(tmp_path / "hfd")
    raise AssertionError(fmt)


FORMATS = ["json-strings", "json-objects", "json-mapping", "jsonl", "txt-folder", "hf-dataset", "hf-dataset-dict"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_the_same_words(tmp_path, fmt):
    corpus = load_corpus([_write(tmp_path, fmt)])

    assert sorted(text.words for text in corpus.texts) == sorted(tuple(t.split()) for t in TEXTS)
    assert len({text.id for text in corpus.texts}) == len(TEXTS)


def test_ids_name_the_source_and_key(tmp_path):
    mapping = load_corpus([_write(tmp_path, "json-mapping")])
    jsonl = load_corpus([_write(tmp_path, "jsonl")])
    single = tmp_path / "story.txt"
    single.write_text(TEXTS[0])

    assert [t.id for t in mapping.texts] == ["c.json:name0", "c.json:name1"]
    assert [t.id for t in jsonl.texts] == ["c.jsonl:1", "c.jsonl:2"]  # JSONL keys are line numbers
    assert [t.id for t in load_corpus([str(single)]).texts] == ["story.txt:story"]


def test_default_corpus_is_pydoc_topics_deduplicated():
    topics = default_topics()

    corpus = load_corpus()
    distinct = {tuple(text.split()) for text in topics.values()} - {()}

    assert len(corpus.texts) == len(distinct)
    assert corpus.dropped_duplicates + corpus.dropped_empty == len(topics) - len(distinct)
    assert all(text.id.startswith("pydoc:") for text in corpus.texts)
    assert corpus.count_at_least(500) == sum(len(words) >= 500 for words in distinct)
    assert corpus.count_at_least(500) >= 2 * 3  # enough for two texts in each of three splits at the last stage


def test_default_corpus_is_the_snapshot_whatever_the_python(monkeypatch):
    """The default texts come from the package's snapshot, never from the running Python's `pydoc_data`."""
    import pydoc_data.topics

    before = load_corpus().texts
    monkeypatch.setattr(pydoc_data.topics, "topics", {"other": "text of another Python version"})

    assert load_corpus().texts == before
    assert len(before) == 78 and before[0].id == "pydoc:assert"


def test_sources_merge_and_same_file_names_get_distinct_ids(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    (tmp_path / "x" / "c.json").write_text(json.dumps(["one two"]))
    (tmp_path / "y" / "c.json").write_text(json.dumps(["three four"]))

    corpus = load_corpus([str(tmp_path / "x" / "c.json"), str(tmp_path / "y" / "c.json"), "pydoc_data.topics"])

    assert [t.words for t in corpus.texts[:2]] == [("one", "two"), ("three", "four")]
    assert len(corpus.texts) == 2 + len(load_corpus().texts)
    assert len({t.id for t in corpus.texts}) == len(corpus.texts)


def test_empty_and_duplicate_texts_are_dropped_and_counted(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(["one two", "", "  \n\t ", "one   two", "three"]))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one\ntwo"}) + "\n" + json.dumps({"text": "four"}) + "\n")

    corpus = load_corpus([str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")])

    assert [t.words for t in corpus.texts] == [("one", "two"), ("three",), ("four",)]
    assert (corpus.dropped_empty, corpus.dropped_duplicates) == (2, 2)


def test_unicode_odd_whitespace_and_very_long_texts(tmp_path):
    odd = " naïve\u00a0café\u2003東京タワー\r\n\r\n😀 end.\x0b"
    long_text = " ".join(f"w{i}" for i in range(200_000))
    (tmp_path / "c.json").write_text(json.dumps([odd, long_text], ensure_ascii=False), encoding="utf-8")

    corpus = load_corpus([str(tmp_path / "c.json")])

    assert corpus.texts[0].words == ("naïve", "café", "東京タワー", "😀", "end.")
    assert corpus.texts[1].n_words == 200_000
    assert corpus.stage_stats([5, 6, 200_000, 200_001]) == {5: 2, 6: 1, 200_000: 1, 200_001: 0}


def test_jsonl_lines_may_hold_unicode_line_separators(tmp_path):
    text = "before\u2028after\u0085end x\u2029y"
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")

    assert load_corpus([str(tmp_path / "c.jsonl")]).texts[0].words == tuple(text.split())


def test_a_bom_at_the_start_of_a_file_is_not_a_word(tmp_path):
    (tmp_path / "c.txt").write_bytes("\ufeffhello world".encode())

    assert load_corpus([str(tmp_path / "c.txt")]).texts[0].words == ("hello", "world")


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("bad.json", '["ok",\n  nope]', "bad.json:2: invalid JSON"),
        ("bad.jsonl", '{"text": "ok"}\n\n{"text": broken\n', "bad.jsonl:3: invalid JSON"),
        ("notext.jsonl", '{"text": "ok"}\n{"body": "no"}\n', "notext.jsonl:2: object has no 'text' field"),
        ("scalar.jsonl", '{"text": "ok"}\n42\n', "scalar.jsonl:2: expected an object"),
        ("notext.json", '[{"text": "ok"}, {"body": "no"}]', "notext.json: item 1: object has no 'text' field"),
        ("nonstring.json", '[{"text": 3}]', "nonstring.json: item 0: 'text' is int"),
        ("mapping.json", '{"good": "ok", "bad": ["x"]}', "mapping.json: key 'bad': expected a string"),
        ("top.json", "3", "top.json: expected a list of texts"),
        ("empty.json", '["", "  "]', "empty corpus"),
        ("c.csv", "a,b", "unsupported file type '.csv'"),
    ],
)
def test_bad_files_name_the_file_and_place(tmp_path, name, content, expected):
    (tmp_path / name).write_text(content)

    with pytest.raises(CorpusError, match=re.escape(expected)) as info:
        load_corpus([str(tmp_path / name)])
    assert "\n" not in str(info.value)


def test_non_utf8_file_is_named_with_the_offending_byte(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))

    with pytest.raises(CorpusError, match=r"latin1\.txt: not UTF-8 \(byte 0xe9 at offset 3\)"):
        load_corpus([str(tmp_path / "latin1.txt")])


def test_missing_paths_and_empty_folders_are_named(tmp_path):
    (tmp_path / "empty").mkdir()

    with pytest.raises(CorpusError, match=r"missing\.jsonl: no such file or directory"):
        load_corpus([str(tmp_path / "missing.jsonl")])
    with pytest.raises(CorpusError, match=r"empty: folder holds no \.txt files"):
        load_corpus([str(tmp_path / "empty")])


def test_a_saved_dataset_without_a_text_column_is_named(tmp_path):
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "hf"))

    with pytest.raises(CorpusError, match=r"hf: dataset has no 'text' column \(columns: body\)"):
        load_corpus([str(tmp_path / "hf")])


@pytest.mark.parametrize("source", ["someone/some-corpus", "hf:wikitext:wikitext-2-raw-v1"])
def test_hub_names_fail_clearly_when_offline(source):
    with pytest.raises(CorpusError, match="hub datasets cannot be loaded offline"):
        load_corpus([source])


def test_fingerprint_follows_file_content(tmp_path):
    source = _write(tmp_path, "jsonl")
    before = corpus_fingerprint([source])
    same = corpus_fingerprint([source])
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "something else"}) + "\n")

    assert before == same
    assert corpus_fingerprint([source]) != before
    assert corpus_fingerprint(None) == corpus_fingerprint(["pydoc_data.topics"])

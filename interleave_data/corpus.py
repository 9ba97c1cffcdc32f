"""Load texts from the embedded default, JSON / JSONL / .txt files, folders, or HF datasets; clean them; count them."""

import functools
import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# The default corpus keeps the name of the module it comes from; its texts are read from a snapshot in the package.
DEFAULT_SOURCE = "pydoc_data.topics"
# CPython 3.11.7's `pydoc_data.topics.topics` ({topic: text}), in its order: every Python reads the same texts, so the
# default pairs (held-out ones included) do not change with the Python version. CPython's documentation is under the
# PSF License Agreement, which allows its redistribution.
DEFAULT_SNAPSHOT = Path(__file__).with_name("pydoc_topics.json.gz")
_HF_PREFIX = "hf:"
# A bare "owner/name" that is not a local path is read as a hub dataset name.
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")
_FILE_SUFFIXES = (".json", ".jsonl", ".txt")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


class CorpusError(ValueError):
    """Bad input to the data package; the message is one line naming the file, line, key or argument."""


@dataclass(frozen=True)
class Text:
    """One cleaned source text.

    Attributes:
        id: Stable, unique id: ``"<source name>:<key or index>"``.
        words: Whitespace-separated tokens, punctuation kept.
    """

    id: str
    words: tuple[str, ...]

    @property
    def n_words(self) -> int:
        return len(self.words)


@dataclass
class Corpus:
    """Cleaned texts plus what cleaning dropped.

    Attributes:
        texts: Non-empty, distinct texts in source order.
        dropped_empty: Texts with no words.
        dropped_duplicates: Texts whose words equal an earlier text's.
    """

    texts: list[Text]
    dropped_empty: int = 0
    dropped_duplicates: int = 0

    def count_at_least(self, n_words: int) -> int:
        """Number of texts long enough for a stage of ``n_words`` words."""
        return sum(text.n_words >= n_words for text in self.texts)

    def stage_stats(self, stages: Iterable[int]) -> dict[int, int]:
        """Maps each stage length to the number of texts that reach it."""
        return {n: self.count_at_least(n) for n in stages}


def load_corpus(sources: Sequence[str] | None = None) -> Corpus:
    """Loads, cleans and merges texts from ``sources``.

    Args:
        sources: Paths (JSON, JSONL, .txt, a folder of .txt files, a HF dataset saved to disk) or hub dataset names
            (``hf:NAME[:CONFIG]`` or ``owner/name``). None or empty means the embedded default, the prose that ships
            with CPython (``pydoc_data.topics``), read from the package's snapshot of CPython 3.11.7's.

    Returns:
        The merged corpus with empty texts and exact duplicates dropped and counted.

    Raises:
        CorpusError: A source is missing or malformed, or the corpus ends up empty.
    """
    sources = list(sources or [DEFAULT_SOURCE])
    texts: list[Text] = []
    seen: set[tuple[str, ...]] = set()
    dropped_empty = dropped_duplicates = 0
    used_names: set[str] = set()
    for source in sources:
        name = _unique_name(_source_name(source), used_names)
        for key, raw in _read_source(source):
            words = tuple(raw.split())
            if not words:
                dropped_empty += 1
            elif words in seen:
                dropped_duplicates += 1
            else:
                seen.add(words)
                texts.append(Text(f"{name}:{key}", words))
    if not texts:
        raise CorpusError(f"empty corpus: no non-empty text in {', '.join(sources)}")
    return Corpus(texts, dropped_empty, dropped_duplicates)


def corpus_fingerprint(sources: Sequence[str] | None = None) -> str:
    """Hashes the raw content behind ``sources``, so caches notice any edit of a corpus file without parsing it."""
    digest = hashlib.sha256()
    for source in sources or [DEFAULT_SOURCE]:
        digest.update(source.encode() + b"\0")
        kind = _kind(source)
        if kind == "default":
            digest.update(json.dumps(default_topics(), sort_keys=True).encode())
        elif kind == "hub":
            # private Dataset._fingerprint (datasets 5.2): the content hash `datasets` keeps; no public accessor
            digest.update(_load_hub(source)._fingerprint.encode())
        else:
            path = Path(source)
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for file in files:
                digest.update(file.relative_to(path).as_posix().encode() if path.is_dir() else b"")
                digest.update(b"\0" + _read_bytes(file))
    return digest.hexdigest()


@functools.cache
def default_topics() -> dict[str, str]:
    """The default corpus's texts, `{topic: text}`, from the package's snapshot of CPython 3.11.7's `pydoc_data`."""
    return json.loads(gzip.decompress(DEFAULT_SNAPSHOT.read_bytes()))


def _kind(source: str) -> str:
    """Tells how to read ``source``: "default", "dir", "file" or "hub"."""
    if source == DEFAULT_SOURCE:
        return "default"
    path = Path(source)
    if path.is_dir():
        return "dir"
    if path.is_file():
        return "file"
    if source.startswith(_HF_PREFIX) or (_HUB_NAME.match(source) and not source.endswith(_FILE_SUFFIXES)):
        return "hub"
    raise CorpusError(f"{source}: no such file or directory")


def _source_name(source: str) -> str:
    kind = _kind(source)
    if kind == "default":
        return "pydoc"
    if kind == "hub":
        return source.removeprefix(_HF_PREFIX).partition(":")[0].rsplit("/", 1)[-1]
    path = Path(source)
    return path.name or path.resolve().name


def _unique_name(name: str, used: set[str]) -> str:
    # Two sources with the same file name must not produce clashing text ids.
    unique, n = name, 1
    while unique in used:
        n += 1
        unique = f"{name}#{n}"
    used.add(unique)
    return unique


def _read_source(source: str) -> Iterator[tuple[str, str]]:
    """Yields ``(key, raw text)`` for every text in one source."""
    kind = _kind(source)
    path = Path(source)
    if kind == "default":
        yield from default_topics().items()
    elif kind == "hub":
        yield from _read_hf_rows(source, _load_hub(source))
    elif kind == "dir":
        yield from _read_dir(path)
    elif path.suffix == ".json":
        yield from _read_json(path)
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".txt":
        yield path.stem, _read_text(path)
    else:
        raise CorpusError(f"{path}: unsupported file type {path.suffix!r} (expected .json, .jsonl or .txt)")


def _read_dir(path: Path) -> Iterator[tuple[str, str]]:
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        yield from _read_saved_hf(path)
        return
    files = sorted(path.rglob("*.txt"))
    if not files:
        raise CorpusError(f"{path}: folder holds no .txt files and is not a saved HF dataset")
    for file in files:
        yield file.relative_to(path).as_posix(), _read_text(file)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise CorpusError(f"{path}: cannot read: {e.strerror}") from None


def _read_text(path: Path) -> str:
    data = _read_bytes(path)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _read_json(path: Path) -> Iterator[tuple[str, str]]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(value, str):
                raise CorpusError(f"{path}: key {key!r}: expected a string, got {type(value).__name__}")
            yield key, value
    elif isinstance(data, list):
        for index, item in enumerate(data):
            yield str(index), _text_of(item, f"{path}: item {index}")
    else:
        raise CorpusError(f"{path}: expected a list of texts or an object mapping name -> text")


def _read_jsonl(path: Path) -> Iterator[tuple[str, str]]:
    # Split on "\n" only: str.splitlines() would also break at U+2028 and friends, legal inside JSON strings.
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(item, dict):
            raise CorpusError(f"{path}:{lineno}: expected an object with a 'text' field")
        yield str(lineno), _text_of(item, f"{path}:{lineno}")


def _text_of(item: object, where: str) -> str:
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        raise CorpusError(f"{where}: expected a string or an object with a 'text' field")
    if "text" not in item:
        raise CorpusError(f"{where}: object has no 'text' field")
    if not isinstance(item["text"], str):
        raise CorpusError(f"{where}: 'text' is {type(item['text']).__name__}, expected a string")
    return item["text"]


def _read_saved_hf(path: Path) -> Iterator[tuple[str, str]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # any library failure becomes one line naming the folder
        raise CorpusError(f"{path}: cannot load saved HF dataset: {first_line(e)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        for split, dataset in loaded.items():
            for key, text in _read_hf_rows(str(path), dataset):
                yield f"{split}/{key}", text
    else:
        yield from _read_hf_rows(str(path), loaded)


def _read_hf_rows(where: str, dataset) -> Iterator[tuple[str, str]]:
    if "text" not in dataset.column_names:
        raise CorpusError(f"{where}: dataset has no 'text' column (columns: {', '.join(dataset.column_names)})")
    for index, text in enumerate(dataset["text"]):
        if not isinstance(text, str):
            raise CorpusError(f"{where}: row {index}: 'text' is {type(text).__name__}, expected a string")
        yield str(index), text


def _load_hub(source: str):
    name, _, config = source.removeprefix(_HF_PREFIX).partition(":")
    if any(os.environ.get(var, "").lower() in ("1", "true", "yes", "on") for var in _OFFLINE_VARS):
        raise CorpusError(f"{source}: not a local file or folder, and hub datasets cannot be loaded offline")
    import datasets

    try:
        return datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # network and hub failures become one line naming the source
        raise CorpusError(
            f"{source}: not a local file or folder, and loading it from the hub failed: {first_line(e)}"
        ) from None


def first_line(error: Exception) -> str:
    """The first line of an error's message (its class name when the message is empty), for one-line errors."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

"""Replace a file or a folder in one step: a reader, or a run killed at any moment, sees the old one or the new."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield `.<name>.tmp` beside `path` for the block to write; rename it over `path` when the block succeeds.

    On an exception the temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing_dir(path: str | os.PathLike, replaceable: Callable[[Path], bool]) -> Iterator[Path]:
    """Yield an empty `.<name>.tmp/` beside `path` for the block to fill; swap it in for `path` when the block succeeds.

    A folder cannot be renamed over a non-empty one, so an existing `path` is first renamed to `.<name>.old` and
    removed after the swap: a run killed between the two renames leaves the complete old folder there, never a mix.
    An existing `path` that is not empty is replaced only if `replaceable(path)` says so (e.g. an earlier export),
    so a folder of the user's own files is never deleted. On an exception `path` is left as it was.

    Raises:
        FileExistsError: `path` holds files and `replaceable` refuses it (checked before anything is written).
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not replaceable(path):
        raise FileExistsError(f"{path}: exists and is not a folder this writes; choose a new or an empty folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
    if old.exists() and not path.exists():  # a run killed between the renames: put the old folder back first
        os.replace(old, path)
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)

"""Replace a file or a folder in one step: a reader, or a run killed at any moment, sees the old one or the new.

It lives in `interleave_data` so that both packages use it: the dataset folders and the Arrow cache here, checkpoints,
reports and exports in `interleave_model` (arrows point `interleave_model -> interleave_data`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, concurrent: bool = False) -> Iterator[Path]:
    """Yield `.<name>.tmp` beside `path` for the block to write; rename it over `path` when the block succeeds.

    On an exception the temporary file is removed and `path` is left as it was.

    Args:
        path: The file to write.
        concurrent: Other processes may write the same content to `path` at the same time (a cache every rank
            writes): the block writes a private file of its own (`.<name>.tmp-<random>`), and the last rename wins.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if concurrent:
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        os.close(handle)
        tmp = Path(name)
    else:
        tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing_dir(
    path: str | os.PathLike, replaceable: Callable[[Path], bool] = lambda folder: False, concurrent: bool = False
) -> Iterator[Path]:
    """Yield an empty `.<name>.tmp/` beside `path` for the block to fill; swap it in for `path` when the block succeeds.

    A folder cannot be renamed over a non-empty one, so an existing `path` is first renamed to `.<name>.old` and
    removed after the swap: a run killed between the two renames leaves the complete old folder there, never a mix,
    and the next write puts it back first. An existing `path` that is not empty is replaced only if
    `replaceable(path)` says so (e.g. an earlier export), so a folder of the user's own files is never deleted.
    On an exception `path` is left as it was.

    Args:
        path: The folder to write.
        replaceable: Whether an existing, non-empty `path` may be replaced.
        concurrent: Other processes may build the same content at `path` at the same time (a cache every rank
            builds): the block fills a private folder of its own (`.<name>.tmp-<random>/`, left behind by a kill),
            and if another process has put `path` in place when the block ends, its identical copy is kept and this
            one dropped. `path` is then never replaced.

    Raises:
        FileExistsError: `path` holds files and `replaceable` refuses it (checked before anything is written).
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not replaceable(path):
        raise FileExistsError(f"{path}: exists and is not a folder this writes; choose a new or an empty folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    if concurrent:
        with _staged(Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))) as tmp:
            yield tmp
            try:
                tmp.rename(path)
            except OSError:
                if not path.exists():
                    raise
        return
    tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
    if old.exists() and not path.exists():  # a run killed between the renames: put the old folder back first
        os.replace(old, path)
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    with _staged(tmp), _staged(old):
        yield tmp
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)


@contextlib.contextmanager
def _staged(folder: Path) -> Iterator[Path]:
    """Remove `folder` when the block ends, however it ends (a no-op once it has been renamed away)."""
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)

"""Concurrent writes: processes writing the same content at once each stage privately; a reader sees one whole copy."""

from __future__ import annotations

import pytest

from interleave_data.atomic import replacing, replacing_dir


def test_a_concurrent_build_finished_first_elsewhere_is_kept_and_this_one_dropped(tmp_path):
    path = tmp_path / "cache"
    with replacing_dir(path, concurrent=True) as mine, replacing_dir(path, concurrent=True) as theirs:
        assert mine != theirs and mine.parent == theirs.parent == tmp_path  # each writer stages in its own folder
        (mine / "data").write_text("mine")
        (theirs / "data").write_text("theirs")
    # `theirs` closed first and was renamed in; `mine` found `path` there, kept it, and was removed
    assert (path / "data").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_failed_concurrent_build_leaves_nothing(tmp_path):
    with pytest.raises(OSError, match="disk full"), replacing_dir(tmp_path / "cache", concurrent=True) as staging:
        (staging / "data").write_text("half")
        raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_of_one_file_each_write_privately_and_the_last_rename_wins(tmp_path):
    path = tmp_path / "counts.json"
    with replacing(path, concurrent=True) as mine, replacing(path, concurrent=True) as theirs:
        assert mine != theirs and mine.parent == theirs.parent == tmp_path
        mine.write_text("mine")
        theirs.write_text("theirs")
    assert path.read_text() == "mine"  # `theirs` was renamed in first, then `mine` over it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counts.json"]

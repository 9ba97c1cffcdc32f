"""The concurrent folder build: processes building the same content at once each stage privately; the first wins."""

from __future__ import annotations

import pytest

from interleave_data.atomic import replacing_dir


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

"""Building the Arrow cache says nothing on the console unless the log level asks for detail."""

from __future__ import annotations

import logging

import pytest

from interleave_data.cache import build_cache, load_cache

BUILD = {"sources": None, "lengths": {"train": [4], "val": [4], "test": [4]},
         "pairs": {"train": 4, "val": 2, "test": 2}, "fractions": [0.8, 0.1, 0.1], "seed": 0}  # fmt: skip


@pytest.mark.parametrize(("level", "bars"), [(logging.WARNING, False), (logging.INFO, True)])
def test_progress_bars_only_at_info(tmp_path, capfd, level, bars):
    logger = logging.getLogger("interleave_data.cache")
    old = logger.level
    logger.setLevel(level)
    try:
        build_cache(tmp_path / "cache", **BUILD)
        load_cache(tmp_path / "cache")
    finally:
        logger.setLevel(old)
    assert ("Saving the dataset" in capfd.readouterr().err) == bars

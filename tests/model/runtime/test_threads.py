"""TorchThreads sets the intra-op thread count at setup and refuses nonsense."""

from __future__ import annotations

import pytest
import torch

from interleave_model.runtime.threads import TorchThreads


def test_setup_sets_the_thread_count():
    before = torch.get_num_threads()
    wanted = 3 if before == 2 else 2  # a count that differs from the current one, so a skipped call shows
    try:
        TorchThreads(num_threads=wanted).setup(None, None, "fit")
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def test_zero_threads_is_refused():
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        TorchThreads(num_threads=0)

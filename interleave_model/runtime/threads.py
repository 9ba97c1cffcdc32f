"""A callback that sets torch's intra-op thread count, for CPU runs of small models."""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override


class TorchThreads(L.Callback):
    """Set `torch.set_num_threads` when the run starts.

    A tiny model's matrices are too small to split across threads: the split costs more than it saves, and on a CPU
    shared with other jobs it is several times slower (a warm-start step went from 0.23 s on one thread to 1.43 s on
    two, on the 2-core dev machine under load). Leave it out for real models.

    Args:
        num_threads: Intra-op threads for this process (each DDP rank sets its own).
    """

    def __init__(self, num_threads: int = 1) -> None:
        if num_threads < 1:
            raise ValueError(f"TorchThreads.num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(self.num_threads)

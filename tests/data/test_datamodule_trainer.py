"""The DataModule under a real Lightning Trainer: stage moves, checkpoint and resume."""

import pytest
import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from interleave_data.datamodule import InterleaveDataModule


class _Recorder(LightningModule):
    """Records what each step receives. Like the project's module it optimizes manually, with two optimizer steps per
    batch, so global_step is not the number of batches."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_batches: list[dict] = []
        self.val_lengths: dict[int, set[int]] = {}

    def training_step(self, batch, batch_idx):
        self.train_batches.append(batch)
        optimizer = self.optimizers()
        for _ in range(2):
            optimizer.zero_grad()
            self.manual_backward((self.weight - batch["prompt_mask"].float().mean()).pow(2).sum())
            optimizer.step()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.val_lengths.setdefault(dataloader_idx, set()).update(batch["n_words"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _MoveAfterBatch(Callback):
    def __init__(self, batch_idx: int):
        self.batch_idx = batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            trainer.datamodule.curriculum.move(1)


def _trainer(max_steps: int, callbacks=(), limit_val_batches: float = 0) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        limit_val_batches=limit_val_batches,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def _dm(tmp_path, tokenizer) -> InterleaveDataModule:
    return InterleaveDataModule(
        stages=[10, 25], train_pairs=8, val_pairs=2, test_pairs=2, batch_size=2, template="compact",
        cache_dir=str(tmp_path / "cache"), tokenizer=tokenizer,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization", "ignore:Be aware that when using")
def test_fit_moves_stage_checkpoints_it_and_resumes_the_stream(tmp_path, tokenizer):
    dm, model = _dm(tmp_path, tokenizer), _Recorder()
    every_two_batches = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=4, save_top_k=-1)

    trainer = _trainer(8, [_MoveAfterBatch(1), every_two_batches])
    trainer.fit(model, datamodule=dm)  # 4 batches, 8 optimizer steps
    trainer.save_checkpoint(tmp_path / "ckpt" / "end.ckpt")

    lengths = [set(batch["n_words"]) for batch in model.train_batches]
    # Lightning fetched batch 2 before the move made at the end of batch 1, so the move shows from batch 3.
    assert lengths == [{10}, {10}, {10}, {25}]
    checkpoint = torch.load(tmp_path / "ckpt" / "step=4.ckpt", weights_only=False)
    assert checkpoint["InterleaveDataModule"]["curriculum"]["drawn_index"] == 1

    resumed_ids = {}
    for name, max_steps in (("step=4.ckpt", 8), ("end.ckpt", 12)):
        resumed_dm, resumed = _dm(tmp_path, tokenizer), _Recorder()
        _trainer(max_steps).fit(resumed, datamodule=resumed_dm, ckpt_path=tmp_path / "ckpt" / name)
        assert resumed_dm.curriculum.state.drawn_index == 1
        resumed_ids[name] = [batch["ids"] for batch in resumed.train_batches]

    def drawn(k):
        return [e.id for e in resumed_dm.sample_train_batch(k)[1]]

    # Saved at the end of batch 1 and at the end of fit: the stream goes on at batch 2 and at batch 4.
    assert resumed_ids == {"step=4.ckpt": [drawn(2), drawn(3)], "end.ckpt": [drawn(4), drawn(5)]}
    assert drawn(3) == model.train_batches[3]["ids"]


def test_validate_runs_one_loader_per_length(tmp_path, tokenizer):
    dm, model = _dm(tmp_path, tokenizer), _Recorder()

    _trainer(1, limit_val_batches=1.0).validate(model, datamodule=dm, verbose=False)

    assert model.val_lengths == {0: {10}, 1: {25}}

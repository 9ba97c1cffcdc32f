"""The GRPO module on a tiny model: what an update may and may not touch, and its guard rails."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from interleave_model.algorithm import grpo
from interleave_model.algorithm.rewards import RewardFunction
from interleave_model.algorithm.schedule import PhaseSchedule
from interleave_model.algorithm.supervised import sft_inputs
from interleave_model.model.policy import LoraSettings, as_reference
from tests.model.algorithm.test_rewards import Constant, Recording


class CompletionLength(RewardFunction):
    """A reward that differs within a group from the first step (an untrained model scores 0 alignment
    everywhere, which gives zero advantages and rightly no update)."""

    name = "length"

    def __call__(self, completions, targets, truncated):
        return [len(c) / 100 for c in completions]


def _fit(module, datamodule, steps: int, **trainer_args) -> L.Trainer:
    """Fit for `steps` steps without validation; `trainer_args` add to the Trainer's arguments (a logger, callbacks)."""
    trainer = L.Trainer(**{
        "accelerator": "cpu", "max_steps": steps, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
    } | trainer_args)  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    return trainer


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _logprobs(module, model, batch):
    ids = torch.cat([batch["prompt_ids"], batch["prompt_ids"][:, -3:]], dim=1)  # any 3 "completion" tokens
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return module._logprobs(model, ids, mask, ids[:, -3:])


def test_grpo_step_moves_trainable_weights_only_and_reference_stays(make_module, make_datamodule):
    module = make_module(rewards=[CompletionLength()], optimization={"learning_rate": 1e-2}, kl={"beta": 0.04})
    datamodule = make_datamodule(module.tokenizer)
    before = _snapshot(module.policy)
    _fit(module, datamodule, steps=1)
    reference = _snapshot(module.reference)
    _fit(module, datamodule, steps=3)
    after = dict(module.policy.named_parameters())
    moved = {k for k, v in before.items() if not torch.equal(v, after[k])}
    trainable = {k for k, v in after.items() if v.requires_grad}
    assert moved and moved <= trainable
    assert "model.embed_tokens.weight" not in moved  # frozen embeddings (tied with the output layer)
    assert all(torch.equal(v, dict(module.reference.named_parameters())[k]) for k, v in reference.items())
    assert not any(p.requires_grad for p in module.reference.parameters())


def test_lora_leaves_base_weights_and_reference_is_the_base_model(make_module, make_datamodule):
    module = make_module(
        lora=LoraSettings(r=4, alpha=8, dropout=0.0),
        rewards=[CompletionLength()],
        optimization={"learning_rate": 1e-2},
        kl={"beta": 0.04},
    )
    datamodule = make_datamodule(module.tokenizer)
    base = _snapshot(module.policy)
    batch = next(iter(datamodule.val_dataloader()[0]))
    base_logprobs = _logprobs(module, module.policy, batch)  # the adapter starts as a no-op (B = 0)
    _fit(module, datamodule, steps=3)
    after = dict(module.policy.named_parameters())
    moved = {k for k, v in base.items() if not torch.equal(v, after[k])}
    assert moved and all("lora_" in k for k in moved)
    assert module.reference is None  # no second copy under LoRA
    with as_reference(module.policy, module.reference) as reference:
        assert torch.equal(_logprobs(module, reference, batch), base_logprobs)
    assert not torch.equal(_logprobs(module, module.policy, batch), base_logprobs)


def test_beta_zero_runs_no_reference(make_module, make_datamodule):
    module = make_module(kl={"beta": 0.0})
    _fit(module, make_datamodule(module.tokenizer), steps=2)
    assert module.reference is None


def test_non_finite_loss_skips_the_step_and_counts_it(make_module, make_datamodule, monkeypatch):
    module = make_module(optimization={"learning_rate": 1e-2})
    datamodule = make_datamodule(module.tokenizer)
    monkeypatch.setattr(
        "interleave_model.module.combine", lambda fns, c, t, tr, **fields: ([float("nan")] * len(c), {})
    )
    before = _snapshot(module.policy)
    trainer = _fit(module, datamodule, steps=2)
    assert module.guard.skipped == 2 and trainer.global_step == 2  # counted, so max_steps still ends the run
    assert not module.trainer.optimizers[0].state  # AdamW never saw a gradient
    assert all(torch.equal(v, dict(module.policy.named_parameters())[k]) for k, v in before.items())


def test_sft_phase_trains_on_target_tokens(make_module, make_datamodule):
    module = make_module(optimization={"sft_learning_rate": 1e-2})
    datamodule = make_datamodule(module.tokenizer, sft_steps=2, sft_batch_size=4)
    batch = datamodule.collate(datamodule.sample_train_batch(0)[1], "sft")
    input_ids, attention_mask, labels = sft_inputs(module.tokenizer, batch, module.device)
    answer = module.tokenizer(batch["targets"][0], add_special_tokens=False)["input_ids"]
    assert labels[0, : len(answer) + 1].tolist() == answer + [module.tokenizer.eos_token_id]
    assert (labels[0, len(answer) + 1 :] == -100).all()
    before = _snapshot(module.policy)
    _fit(module, datamodule, steps=2)
    assert module.reference is None  # GRPO never started
    assert any(not torch.equal(v, dict(module.policy.named_parameters())[k]) for k, v in before.items())


class Gradients(L.Callback):
    """The trainable parameters' gradients just before the first optimizer step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not hasattr(self, "grads"):
            self.grads = {k: p.grad.clone() for k, p in pl_module.policy.named_parameters() if p.grad is not None}


def test_a_supervised_step_in_micro_batches_has_the_whole_batch_gradient(make_module, make_datamodule, family_folders):
    # 4 pairs one at a time on a Llama-3-style folder (byte-level BPE: the pairs' targets have different token
    # counts): each chunk weighted by its share of the target tokens, so the gradient is the one of the 4 at once
    # (up to summation order), with the activations of one pair held at a time; weighting by rows would differ
    grads, rows_seen, counts = {}, {}, set()
    for size in (None, 1):
        module = make_module(
            seed=5, base={"name_or_path": str(family_folders["llama3"])}, optimization={"micro_batch_size": size}
        )
        seen = rows_seen.setdefault(size, [])
        decoder = module.policy.get_decoder()
        decoder.register_forward_pre_hook(
            lambda mod, args, kw, seen=seen: seen.append(len(kw["input_ids"])), with_kwargs=True
        )
        datamodule, callback = make_datamodule(module.tokenizer, sft_steps=1, sft_batch_size=4), Gradients()
        counts |= {len(ids) for ids in datamodule.collate(datamodule.sample_train_batch(0)[1], "sft")["target_ids"]}
        _fit(module, datamodule, steps=1, callbacks=[callback])
        grads[size] = callback.grads
    assert rows_seen == {None: [4], 1: [1, 1, 1, 1]} and len(counts) > 1
    assert grads[None].keys() == grads[1].keys() and grads[None]
    for name, whole in grads[None].items():
        torch.testing.assert_close(grads[1][name], whole, rtol=1e-4, atol=1e-7)


def test_bad_settings_are_refused_before_training(make_module, make_datamodule):
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        make_module(sampling={"num_generations": 1})
    module = make_module(sampling={"max_new_tokens": 3})
    batch = next(iter(make_datamodule(module.tokenizer).val_dataloader()[1]))  # 8-word stage: 16-token answers
    with pytest.raises(ValueError, match="max_new_tokens=3 cannot hold a 17-token answer"):
        module.greedy(batch)


def test_budget_follows_the_stage(make_module, make_datamodule):
    module = make_module()
    loaders = make_datamodule(module.tokenizer).val_dataloader()
    short, long = (module.sampler.budget(next(iter(loader))["target_ids"]) for loader in loaders)
    assert short < long and long >= 17  # an 8-word stage answers 16 words + EOS


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_rewards_sharing_a_name_are_summed_and_logged_apart(make_module, make_datamodule):
    # reward = 1.0 * 0.25 + 2.0 * 0.5 = 1.25 for every completion; each term logged under its own key
    module = make_module(rewards=[Constant(0.25), Constant(0.5, weight=2.0)], kl={"beta": 0.0})
    batch = next(iter(make_datamodule(module.tokenizer).val_dataloader()[0]))
    trajectory, stats = module.generate_trajectory(batch)
    assert trajectory.rewards.tolist() == [1.25] * trajectory.rewards.numel()
    assert stats["train/reward_constant"] == 0.25 and stats["train/reward_constant_2"] == 0.5


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_rewards_see_each_completions_prompt_fragments_and_length(make_module, make_datamodule):
    reward = Recording()
    module = make_module(rewards=[reward], kl={"beta": 0.0}, sampling={"num_generations": 3})
    batch = next(iter(make_datamodule(module.tokenizer).val_dataloader()[0]))
    module.generate_trajectory(batch)
    each = lambda values: [v for v in values for _ in range(3)]  # noqa: E731  group-major, as the completions
    assert reward.fields == {name: each(batch[name]) for name in ("prompts", "a", "b", "n_words", "ids")}
    for prompt, a, b in zip(reward.fields["prompts"], reward.fields["a"], reward.fields["b"], strict=True):
        assert a in prompt and b in prompt  # the fragments are the prompt's


def test_dr_grpo_divides_by_the_configured_constant_not_the_batch_width(make_module, make_datamodule, monkeypatch):
    with pytest.raises(ValueError, match=r"dr_grpo needs model\.loss\.max_completion_length"):
        make_module(loss={"loss_type": "dr_grpo"})  # at construction, not after a warm-start
    make_module(loss={"loss_type": "dr_grpo"}, sampling={"max_new_tokens": 24})  # a fixed budget is the constant
    seen, policy_loss = [], grpo.policy_loss

    def spy(logprobs, *args, **kwargs):
        seen.append((kwargs["max_completion_length"], logprobs.shape[1]))
        return policy_loss(logprobs, *args, **kwargs)

    monkeypatch.setattr("interleave_model.module.grpo.policy_loss", spy)
    module = make_module(
        rewards=[CompletionLength()],
        loss={"loss_type": "dr_grpo", "max_completion_length": 50},
        sampling={"max_new_tokens": 24},
    )
    _fit(module, make_datamodule(module.tokenizer), steps=2)
    assert [length for length, _ in seen] == [50, 50]
    assert all(width <= 24 for _, width in seen)  # the rollout's width was never the normaliser


def test_k1_in_the_loss_warns_in_one_line(make_module, capsys):
    make_module(kl={"estimator": "k1", "beta": 0.04})
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "k1" in line] == [
        "warning: model.kl.estimator: k1 has zero expected gradient as a loss term, so beta > 0 regularises "
        "nothing; use k3 (or k2)"
    ]
    make_module(kl={"estimator": "k1", "beta": 0.0})  # measured only: nothing to warn about
    make_module(kl={"estimator": "k3", "beta": 0.04})
    assert "k1" not in capsys.readouterr().err


class Snapshots(L.Callback):
    """Copies of the weights and the optimizer state after every training batch."""

    def __init__(self):
        self.taken = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])
        self.taken.append((_snapshot(pl_module.policy), state))


def _infinite_gradient_in_backward(module, n: int) -> list[int]:
    """Make the `n`-th backward's gradient infinite (the loss stays finite); the list returned counts the backwards."""
    backwards = []

    def hook(grad):
        backwards.append(1)
        return torch.full_like(grad, float("inf")) if len(backwards) == n else grad

    module.policy.model.norm.weight.register_hook(hook)
    return backwards


def test_non_finite_gradient_norm_skips_the_step_and_counts_it(make_module, make_datamodule):
    module = make_module(rewards=[CompletionLength()], optimization={"learning_rate": 1e-2}, kl={"beta": 0.0})
    calls = _infinite_gradient_in_backward(module, 2)
    snapshots = Snapshots()
    trainer = _fit(module, make_datamodule(module.tokenizer), steps=2, callbacks=[snapshots])
    assert len(calls) == 2 and module.guard.skipped == 1 and trainer.global_step == 2
    (weights_1, state_1), (weights_2, state_2) = snapshots.taken
    assert state_1  # the first step was taken
    assert all(torch.equal(v, weights_2[k]) for k, v in weights_1.items())  # bitwise: nothing moved
    assert state_1.keys() == state_2.keys()
    for i, values in state_1.items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(state_2[i][name])) for name, v in values.items())


def test_16_mixed_clips_the_unscaled_gradients(make_module, make_datamodule):
    # The Trainer turns "16-mixed" on a CPU into bf16 (no scaler); the plugin keeps fp16 and a GradScaler. With a scale
    # of 2**10, clipping the scaled gradients to 1e-3 would leave 1e-3 / 1024 ~ 1e-6 after unscaling.
    from lightning.pytorch.plugins import MixedPrecision

    module = make_module(
        rewards=[CompletionLength()], optimization={"learning_rate": 1e-2, "max_grad_norm": 1e-3}, kl={"beta": 0.0}
    )
    norms = []

    def record(optimizer, args, kwargs):  # runs as AdamW steps, after the scaler and the clip
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.nn.utils.get_total_norm(grads).item())

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handle = register_optimizer_step_pre_hook(record)
    try:
        _fit(module, make_datamodule(module.tokenizer), steps=2, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    finally:
        handle.remove()
    assert norms and module.guard.skipped == 0
    assert norms == pytest.approx([1e-3] * len(norms), rel=1e-3)  # the true gradients were far larger than 1e-3


class Captured(Logger):
    """A logger that keeps every row Lightning hands it, as `(step, metrics)`."""

    name, version = "captured", 0

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize("cause", ["gradient", "loss"])
def test_a_skipped_step_logs_no_learning_rate_counts_itself_and_each_step_logs_at_its_global_step(
    cause, make_module, make_datamodule, monkeypatch
):
    # step 1 is the warm-start, steps 2-4 GRPO; step 3 is skipped, for an infinite gradient norm or a NaN loss
    module = make_module(rewards=[CompletionLength()], optimization={"learning_rate": 1e-2}, kl={"beta": 0.0})
    if cause == "gradient":
        _infinite_gradient_in_backward(module, 3)
    else:
        rollouts = []

        def second_rollout_is_nan(functions, completions, targets, truncated, **fields):
            rollouts.append(1)
            return [float("nan") if len(rollouts) == 2 else len(c) / 100 for c in completions], {}

        monkeypatch.setattr("interleave_model.module.combine", second_rollout_is_nan)
    logger, datamodule = Captured(), make_datamodule(module.tokenizer, sft_steps=1, sft_batch_size=2)
    _fit(module, datamodule, steps=4, logger=logger, log_every_n_steps=1)

    assert module.guard.skipped == 1
    # (step, learning rate logged, skipped steps so far, warm-start loss logged, GRPO loss logged): a key a step does
    # not measure is absent (Lightning would repeat its last value), and the step is the trainer's global_step
    table = [(step, "train/lr" in m, m.get("train/skipped_steps"), "train/sft_loss" in m, "train/loss" in m)
             for step, m in logger.rows]  # fmt: skip
    assert table == [
        (1, True, 0.0, True, False),
        (2, True, 0.0, False, True),
        (3, False, 1.0, False, True),
        (4, True, 1.0, False, True),
    ]


def test_a_batch_of_several_updates_logs_at_the_global_step_after_them(make_module, make_datamodule):
    module = make_module(rewards=[CompletionLength()], loss={"num_iterations": 2}, kl={"beta": 0.0})
    logger = Captured()
    _fit(module, make_datamodule(module.tokenizer), steps=4, logger=logger, log_every_n_steps=1)
    assert [step for step, _ in logger.rows] == [2, 4]  # two batches of two optimizer steps each


class NormsOfGradients(TorchDispatchMode):
    """Counts how many times an op takes the norm of one of `params`' gradients."""

    OPS = (torch.ops.aten._foreach_norm, torch.ops.aten.linalg_vector_norm, torch.ops.aten.norm)

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.grads = {id(p.grad) for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.OPS:
            tensors = args[0] if isinstance(args[0], list | tuple) else [args[0]]
            self.count += sum(id(t) in self.grads for t in tensors)
        return func(*args, **(kwargs or {}))


def test_the_gradient_norm_is_taken_once_per_step_and_clips_as_clip_grad_norm(make_module, make_datamodule):
    module = make_module(
        rewards=[CompletionLength()], optimization={"learning_rate": 1e-2, "max_grad_norm": 1e-3}, kl={"beta": 0.0}
    )
    hook, steps = module.on_before_optimizer_step, []

    def measured(optimizer):  # the module's own hook: skip or clip
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        expected = [torch.zeros_like(p).requires_grad_() for p in params]  # the same gradients, clipped by torch
        for copy_, p in zip(expected, params, strict=True):
            copy_.grad = p.grad.clone()
        torch.nn.utils.clip_grad_norm_(expected, 1e-3)
        with NormsOfGradients(params) as norms:
            hook(optimizer)
        same = all(torch.equal(e.grad, p.grad) for e, p in zip(expected, params, strict=True))
        steps.append((norms.count / len(params), same))

    module.on_before_optimizer_step = measured
    _fit(module, make_datamodule(module.tokenizer), steps=2)
    assert steps == [(1.0, True), (1.0, True)]  # each gradient's norm taken once a step; bitwise the same clip


class FakeTrainer:
    def __init__(self, strategy):
        self.strategy, self.datamodule = strategy, None


def test_clipping_under_fsdp_is_refused_when_fit_sets_up(make_module):
    from lightning.pytorch.strategies import FSDPStrategy

    module = make_module()
    module.trainer = FakeTrainer(FSDPStrategy())
    with pytest.raises(ValueError, match="max_grad_norm: clipping needs whole gradients on each rank"):
        module.setup("fit")  # the norm StepGuard takes would be one shard's
    module.setup("validate")  # nothing is clipped there
    unclipped = make_module(optimization={"max_grad_norm": 0})
    unclipped.trainer = FakeTrainer(FSDPStrategy())
    unclipped.setup("fit")


def test_a_warm_start_ended_early_starts_grpo_there_with_its_warm_up(make_module, make_datamodule, tmp_path):
    # sft_steps 10, but the curriculum ended the warm-start at batch 2 (as a validation reaching warm_start_until
    # does): steps 1-2 are supervised, 3-4 GRPO, whose learning rate warms up from step 3 (warm-up 2: 1/3, 2/3)
    module = make_module(
        rewards=[CompletionLength()], optimization={"learning_rate": 3e-2, "warmup_steps": 2}, kl={"beta": 0.0}
    )
    logger, datamodule = Captured(), make_datamodule(module.tokenizer, sft_steps=10, sft_batch_size=2)
    datamodule.curriculum.state.warm_end = 2
    trainer = _fit(module, datamodule, steps=4, logger=logger, log_every_n_steps=1)

    assert [("train/sft_loss" in m, "train/loss" in m) for _, m in logger.rows] == [(True, False)] * 2 + [
        (False, True)
    ] * 2
    assert module.grpo_start == 2
    assert [round(m["train/lr"], 6) for _, m in logger.rows[2:]] == [0.01, 0.02]
    assert isinstance(module.lr_schedulers(), PhaseSchedule)  # AdamW's schedule, as Lightning holds it
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    # a resumed run keeps GRPO's schedule: the restored curriculum hands the GRPO batches their start
    resumed = make_module(
        rewards=[CompletionLength()], optimization={"learning_rate": 3e-2, "warmup_steps": 2}, kl={"beta": 0.0}
    )
    logger = Captured()
    again = make_datamodule(resumed.tokenizer, sft_steps=10, sft_batch_size=2)
    L.Trainer(accelerator="cpu", max_steps=5, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              num_sanity_val_steps=0).fit(resumed, datamodule=again, ckpt_path=tmp_path / "run.ckpt")  # fmt: skip
    (row,) = [m for _, m in logger.rows]
    assert resumed.grpo_start == 2 and again.curriculum.grpo_start == 2 and "train/loss" in row
    # step 4 is GRPO's third step from 2: past its warm-up of 2, the full (constant) rate, not a warm-up from 10
    assert round(row["train/lr"], 6) == 0.03


def test_the_module_owns_the_rollout_temperature_and_checkpoints_it(make_module, make_datamodule, tmp_path):
    module = make_module(sampling={"temperature": 0.7}, kl={"beta": 0.0})
    seen = []
    rollout = module._rollout
    module._rollout = lambda batch, G, temperature, generator=None: (
        seen.append(temperature) or rollout(batch, G, temperature, generator)
    )
    module.set_temperature(1.3)  # what a curriculum's raise_temperature does
    trainer = _fit(module, make_datamodule(module.tokenizer), steps=1)

    assert seen == [1.3] and module.sampling.temperature == 0.7 and module.hparams.sampling["temperature"] == 0.7
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=False)
    resumed = make_module(sampling={"temperature": 0.7})
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.temperature == 1.3
    older = make_module(sampling={"temperature": 0.7})  # a checkpoint without the entry: the configured temperature
    checkpoint.pop("temperature")
    older.on_load_checkpoint(checkpoint)
    assert older.temperature == 0.7


def test_grpo_starts_with_fresh_adamw_moments_after_the_warm_start(make_module, make_datamodule):
    module = make_module(rewards=[CompletionLength()], kl={"beta": 0.0})
    datamodule = make_datamodule(module.tokenizer, sft_steps=2, sft_batch_size=2)
    optimizer_steps = []
    module.on_train_batch_end = lambda *args: optimizer_steps.append(
        {int(state["step"]) for state in module.optimizers().optimizer.state.values()}
    )
    _fit(module, datamodule, steps=4)
    # two supervised steps, then GRPO's moments count from its own first step, as a run from the warm weights
    assert optimizer_steps == [{1}, {2}, {1}, {2}]


def test_an_optimizer_configured_without_a_schedule_keeps_its_own_rate(make_module, make_datamodule):
    # a subclass's configure_optimizers returning a bare optimizer (no PhaseSchedule): both phases step at its rate
    module = make_module(rewards=[CompletionLength()], kl={"beta": 0.0})
    params = [p for p in module.policy.parameters() if p.requires_grad]
    module.configure_optimizers = lambda: torch.optim.SGD(params, lr=0.05)
    datamodule = make_datamodule(module.tokenizer, sft_steps=1, sft_batch_size=2)
    before = _snapshot(module.policy)
    trainer = _fit(module, datamodule, steps=3)
    assert trainer.global_step == 3 and module.lr_schedulers() is None
    assert module.optimizers().param_groups[0]["lr"] == 0.05
    assert any(not torch.equal(before[k], v) for k, v in _snapshot(module.policy).items())  # it trained

"""The model's settings in groups, and checkpoints written before the groups existed or before the auxiliary terms
had theirs."""

from __future__ import annotations

from dataclasses import asdict

import lightning as L
import pytest
import torch

from interleave_model.config_keys import MovedKeyError, check_moved_keys
from interleave_model.model import migrations
from interleave_model.model.migrations import FLAT_NAMES, LOSS_MOVED, REMOVED, migrated_hparams
from interleave_model.module import InterleaveGRPO
from interleave_model.settings.evaluation import Evaluation
from interleave_model.settings.groups import GROUPS, as_group
from interleave_model.settings.loss import Kl, Loss
from interleave_model.settings.optimization import Optimization
from interleave_model.settings.sampling import Sampling
from tests.conftest import flat_settings

# The flat settings of InterleaveGRPO before they were grouped (its signature at commit 35e5889): every one of them
# must find its group, or an older checkpoint would silently lose it.
FLAT_BEFORE = [
    "num_generations", "temperature", "top_p", "top_k", "max_new_tokens", "budget_margin", "beta", "kl_estimator",
    "epsilon", "epsilon_high", "num_iterations", "loss_type", "max_completion_length", "scale_rewards",
    "advantage_estimator", "learning_rate", "sft_learning_rate", "weight_decay", "warmup_steps", "lr_schedule",
    "sft_steps", "max_grad_norm", "micro_batch_size", "eval_num_samples", "eval_temperature", "pass_k",
    "pass_threshold", "model_name_or_path", "dtype", "attn_implementation", "trust_remote_code",
    "gradient_checkpointing", "disable_dropout", "init_from",
]  # fmt: skip


def test_every_flat_setting_of_before_has_a_group_and_every_group_field_a_flat_name():
    assert set(FLAT_BEFORE) <= set(FLAT_NAMES)  # settings added since have flat names too: conftest.flat_settings
    fields = {(group, name) for group, cls in GROUPS.items() for name in asdict(cls())}
    # settings removed since: found, then dropped; a term's (`guidance.loss`) had its flat name in `loss`: `in_loss`
    removed = {(group, name) for group, name in REMOVED if group in GROUPS}
    in_loss = {("loss", name) for name in LOSS_MOVED}  # the terms' settings: into `loss`, then out to their groups
    kl = {("kl", name) for name in asdict(Kl())}  # reached through `in_loss`
    assert set(FLAT_NAMES.values()) == (fields - kl) | removed | in_loss and not fields & (removed | in_loss)


def test_a_removed_setting_of_an_old_checkpoint_is_dropped_with_one_line(caplog, monkeypatch):
    monkeypatch.setattr(migrations, "TOLD", set())  # a fresh process
    with caplog.at_level("INFO"):
        grouped = migrated_hparams({"optimization": {"sft_steps": 5, "learning_rate": 2e-4}, "seed": 1})
        flat = migrated_hparams({"sft_steps": 5, "learning_rate": 2e-4})
    assert grouped["optimization"] == flat["optimization"] == {"learning_rate": 2e-4} and grouped["seed"] == 1
    assert "model.optimization.sft_steps is no longer a setting, ignored (the data's data.sft_steps" in caplog.text
    with caplog.at_level("INFO"):  # a setting that lost its screen: a run saved with it loads as GRPO
        assert migrated_hparams({"loss": {"advantage_sign": "positive", "epsilon": 0.3}})["loss"] == {"epsilon": 0.3}
    assert "model.loss.advantage_sign is no longer a setting, ignored (learning from one sign" in caplog.text
    with caplog.at_level("INFO"):  # CHORD-phi's term, grouped or still in `loss`: resumed with the plain cross-entropy
        assert migrated_hparams({"guidance": {"weight": 0.5, "loss": "phi"}})["guidance"] == {"weight": 0.5}
        assert migrated_hparams({"loss": {"guidance": 0.5, "guidance_loss": "phi"}})["guidance"] == {"weight": 0.5}
    assert caplog.text.count("model.guidance.loss is no longer a setting, ignored (CHORD-phi changed nothing") == 1
    assert caplog.text.count("model.optimization.sft_steps is no longer a setting") == 1  # read twice, said once
    with pytest.raises(TypeError):
        as_group(Optimization, {"learning_rat": 2e-4})  # a name that never was one is still refused


def test_a_removed_group_of_an_old_checkpoint_is_dropped_with_one_line_where_it_was_on(caplog, monkeypatch):
    monkeypatch.setattr(migrations, "TOLD", set())  # a fresh process
    with caplog.at_level("INFO"):
        assert migrated_hparams({"seed": 1, "reference_in_group": None}) == {"seed": 1}  # off: nothing to say
    assert "reference_in_group" not in caplog.text
    with caplog.at_level("INFO"):  # LUFFY's group, on: grouped, in `loss` as a switch, or flat; each loads as GRPO
        grouped = migrated_hparams({"seed": 1, "reference_in_group": {"shaping_gamma": 0.1}})
        in_loss = migrated_hparams({"loss": {"reference_in_group": True, "shaping_gamma": 0.2, "epsilon": 0.3}})
        flat = migrated_hparams({"reference_in_group": True, "shaping_gamma": 0.2, "epsilon": 0.3})
    assert grouped == {"seed": 1} and in_loss == flat == {"loss": {"epsilon": 0.3}, "kl": {}, "guidance": None}
    assert caplog.text.count("model.reference_in_group is no longer a setting, ignored (the known answer") == 1


def test_flat_settings_go_into_their_groups_and_the_rest_stays():
    flat = {"seed": 3, "temperature": 0.7, "eval_temperature": 0.3, "beta": 0.0, "learning_rate": 2e-4, "pass_k": [1]}
    assert migrated_hparams(flat) == {
        "seed": 3,
        "sampling": {"temperature": 0.7},
        "evaluation": {"temperature": 0.3, "pass_k": [1]},
        "loss": {},
        "kl": {"beta": 0.0},
        "guidance": None,
        "optimization": {"learning_rate": 2e-4},
    }


def test_grouped_settings_come_back_unchanged():
    grouped = {"seed": 1, "sampling": {"num_generations": 4}, "loss": asdict(Loss()), "kl": asdict(Kl(beta=0.1))}
    assert migrated_hparams(grouped) == grouped


@pytest.mark.parametrize(
    ("loss", "terms"),
    [
        (
            {"beta": 0.1, "kl_estimator": "k2", "guidance": 0.5, "guidance_loss": "ce", "reference_in_group": True,
             "shaping_gamma": 0.2, "epsilon": 0.3},
            {"kl": {"beta": 0.1, "estimator": "k2"}, "guidance": {"weight": 0.5}},  # the two removed since: dropped
        ),
        (  # the terms off, as the old switches wrote it
            {"beta": 0.0, "guidance": 0.0, "guidance_final": 0.0, "reference_in_group": False, "shaping_gamma": 0.1,
             "epsilon": 0.3},
            {"kl": {"beta": 0.0}, "guidance": None},
        ),
    ],
)  # fmt: skip
def test_the_terms_settings_of_an_old_loss_go_into_their_groups(loss, terms):
    grouped = migrated_hparams({"seed": 1, "loss": loss})
    assert grouped == {"seed": 1, "loss": {"epsilon": 0.3}} | terms


def test_each_group_checks_its_own_values_when_built():
    with pytest.raises(ValueError, match=r"model\.sampling\.num_generations must be >= 2"):
        Sampling(num_generations=1)
    with pytest.raises(ValueError, match=r"model\.loss\.max_completion_length must be >= 1"):
        Loss(max_completion_length=0)
    with pytest.raises(ValueError, match=r"model\.evaluation\.pass_k must be in \[1, num_samples=2\]"):
        Evaluation(num_samples=2, pass_k=[3])
    assert Kl(estimator="k1", beta=0.04).wasted  # the module warns (test_module)
    assert not Kl(estimator="k1", beta=0.0).wasted and not Kl(estimator="k3", beta=0.04).wasted
    with pytest.raises(ValueError, match=r"model\.kl\.beta must be >= 0"):
        Kl(beta=-1.0)


def test_hparams_hold_plain_dicts_and_the_module_typed_copies(make_module):
    module = make_module(
        sampling={"temperature": 0.9}, optimization={"learning_rate": 0.5}, evaluation={"num_samples": 2}
    )
    assert module.sampling == Sampling(num_generations=2, temperature=0.9)
    assert module.optimization == Optimization(learning_rate=0.5)
    assert module.evaluation == Evaluation(num_samples=2) and module.evaluator.pass_k == [1, 2]
    # plain data: a checkpoint's hyperparameters load with weights_only=True and parse back into a config
    assert module.hparams.sampling == asdict(module.sampling) and isinstance(module.hparams.loss, dict)


def test_the_default_groups_are_never_shared_between_modules(make_module):
    first, second = InterleaveGRPO(tiny=make_module().hparams.tiny, template="compact"), make_module()
    first.sampling.temperature = 1.5  # one module's group changed
    assert second.sampling.temperature == 1.0 and Sampling().temperature == 1.0


def test_a_checkpoint_with_flat_settings_loads_with_them(make_module, tmp_path):
    module = make_module(
        sampling={"temperature": 0.7, "top_k": 5},
        kl={"beta": 0.0},
        optimization={"learning_rate": 0.03},
        evaluation={"temperature": 0.2},
    )
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=0)
    trainer.strategy.connect(module)
    path = tmp_path / "grouped.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint.pop(migrations.CHECKPOINT_VERSION, None)  # written before the layout's version was stamped
    checkpoint["hyper_parameters"] = flat_settings(checkpoint["hyper_parameters"])
    assert "temperature" in checkpoint["hyper_parameters"] and "sampling" not in checkpoint["hyper_parameters"]
    torch.save(checkpoint, tmp_path / "flat.ckpt")

    loaded = InterleaveGRPO.load_from_checkpoint(tmp_path / "flat.ckpt")
    assert (loaded.base, loaded.sampling, loaded.loss) == (module.base, module.sampling, module.loss)
    assert loaded.kl == module.kl and loaded.guidance is None
    assert (loaded.optimization, loaded.evaluation) == (module.optimization, module.evaluation)
    assert loaded.sampling.top_k == 5 and loaded.evaluation.temperature == 0.2
    weights = module.state_dict()
    assert all(torch.equal(value, weights[key]) for key, value in loaded.state_dict().items())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "--model.model_name_or_path", "x"], "--model.model_name_or_path is now --model.base.name_or_path"),
        (["fit", "--model.init_from=a.ckpt"], "--model.init_from is now --model.base.init_from"),
        (["fit", "--config", "{old}"], "{old}: model.dtype is now model.base.dtype"),
        (["fit", "--config={nested}"], "{nested}: model.init_from is now model.base.init_from"),
        (["fit", "--model.loss.beta=0.1"], "--model.loss.beta is now --model.kl.beta"),
        (["fit", "--model.loss.kl_estimator", "k2"], "--model.loss.kl_estimator is now --model.kl.estimator"),
        (["fit", "--config", "{terms}"], "{terms}: model.loss.guidance is now model.guidance.weight"),
        (
            ["fit", "--config", "{saved}"],
            "{saved}: optimizer and lr_scheduler are not settings here (AdamW with its "
            "schedule from model.optimization): delete the lines",
        ),
    ],
)
def test_a_moved_key_is_refused_in_one_line_that_names_the_new_one(tmp_path, args, message):
    paths = {name: tmp_path / f"{name}.yaml" for name in ("old", "nested", "terms", "saved")}
    paths["old"].write_text("model:\n  dtype: float32\n")
    paths["nested"].write_text("model:\n  init_args:\n    init_from: a.ckpt\n")
    paths["terms"].write_text("model:\n  loss:\n    epsilon: 0.2\n    guidance: 0.5\n")
    paths["saved"].write_text("trainer:\n  max_steps: 2\noptimizer: null\nlr_scheduler: null\n")  # a run's config.yaml
    with pytest.raises(MovedKeyError) as raised:
        check_moved_keys([a.format(**paths) for a in args])
    assert str(raised.value) == message.format(**paths)


def test_a_key_whose_new_home_left_the_code_is_left_to_the_parser():
    check_moved_keys(["fit", "--model.loss.reference_in_group", "true", "--model.loss.guidance_loss=ce",
                      "--model.loss.guidance_final", "0.1"])  # fmt: skip


def test_todays_keys_and_configs_pass(tmp_path):
    check_moved_keys(["fit", "--config", "configs/smollm2.yaml", "--model.base.dtype", "float32", "--config"])

"""CurriculumCallback acting on the curriculum, SampleDump, stage exports, `init_from` and dynamic sampling.

Decisions are driven through the real hooks with a stand-in trainer: every batch is a `StepRecord` whose rewards
are written out, so each test reads as "these rewards, then this decision". The decisions alone, without a trainer,
are in tests/data/test_curriculum.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from interleave_data.curriculum import Curriculum
from interleave_data.curriculum_types import CurriculumSettings, SmallerStep, StopAdvice
from interleave_model.algorithm.dynamic_sampling import DynamicSampling, concat, refill, select_groups
from interleave_model.algorithm.records import StepRecord, Trajectory
from interleave_model.algorithm.rewards import RewardFunction
from interleave_model.generation.rollout import Rollout
from interleave_model.model.checkpoint import load_initial_weights
from interleave_model.model.export import export
from interleave_model.model.policy import LoraSettings, PolicyError
from interleave_model.run.callbacks import CurriculumCallback, stop_message
from interleave_model.run.samples import SampleDump
from interleave_model.settings.sampling import Sampling

G = 2


class _DataModule:
    """Holds the curriculum, as InterleaveDataModule does; `moves` lists each move as (stage index, from batch)."""

    def __init__(self, stages=(4, 8, 16), sft_steps=0, **settings):
        self.curriculum = Curriculum(stages, settings=CurriculumSettings(**settings), sft_steps=sft_steps)
        self.batches_run = 0

    @property
    def moves(self) -> list[tuple[int, int]]:
        c = self.curriculum
        return [(c.stages.index(h["to_words"]), h["from_batch"]) for h in c.state.history if "from_batch" in h]


class _Trainer:
    """The parts of a Trainer the callbacks read; `batch()` plays one training batch through the hooks."""

    def __init__(self, tmp_path, stages=(4, 8, 16)):
        self.datamodule = _DataModule(stages)
        self.strategy = SimpleNamespace(reduce=lambda tensor, reduce_op: tensor)
        self.global_step, self.should_stop, self.sanity_checking = 0, False, False
        self.loggers, self.is_global_zero, self.world_size, self.global_rank = [], True, 1, 0
        self.log_dir = self.default_root_dir = str(tmp_path)
        self.callback_metrics = {}
        self.logged = {}
        self.module = SimpleNamespace(
            sampling=Sampling(temperature=1.0, num_generations=2), temperature=1.0, device=torch.device("cpu"),
            log_dict=lambda values, batch_size: self.logged.update(values),
            set_temperature=lambda value: setattr(self.module, "temperature", value),  # the module's one setter
        )  # fmt: skip

    def batch(self, callbacks, rewards, n_words, completions=None):
        """One batch: `rewards` is one list of G rewards per prompt, `n_words` one length per prompt."""
        index, self.datamodule.batches_run = self.datamodule.batches_run, self.datamodule.batches_run + 1
        self.global_step += 1
        flat = [r for group in rewards for r in group]
        completions = completions or [f"answer {i}" for i in range(len(flat))]
        record = StepRecord(
            [f"prompt {i}" for i in range(len(n_words))], [f"t{i} u{i}" for i in range(len(n_words))], list(n_words),
            completions, torch.tensor(flat), G,
        )  # fmt: skip
        for callback in callbacks:
            callback.on_train_batch_end(self, self.module, {"record": record}, {"batch_index": index}, 0)


def _curriculum(trainer, export=False, sft_steps=0, **settings) -> CurriculumCallback:
    """A CurriculumCallback over a fresh curriculum with these settings (window 1 unless given); the batches run so
    far stay counted, as a DataModule restored from a checkpoint keeps them."""
    stages, run = trainer.datamodule.curriculum.stages, trainer.datamodule.batches_run
    trainer.datamodule = _DataModule(stages, sft_steps, **({"window": 1} | settings))
    trainer.datamodule.batches_run = run
    callback = CurriculumCallback(export=export)
    callback.setup(trainer, trainer.module, "fit")
    return callback


GOOD, BAD, STUCK = [0.9, 1.0], [0.1, 0.6], [0.0, 0.0]


def test_advances_once_the_reward_held_the_threshold_for_patience_batches(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, threshold=0.8, patience=3, min_steps=0)

    for rewards in (GOOD, GOOD, BAD, GOOD, GOOD):  # the dip restarts the count
        trainer.batch([cb], [rewards], [4])
    assert trainer.datamodule.moves == []
    trainer.batch([cb], [GOOD], [4])

    # decided after batch 6 (6 batches run); batch 7 is already fetched, so the move shows from batch 8 (index 7)
    assert trainer.datamodule.moves == [(1, 7)]
    assert cb.curriculum.state.stage_index == 1 and cb.curriculum.state.steps == 0
    assert cb.curriculum.state.history[-1] | {"why": ""} == {
        "kind": "advance", "from_words": 4, "to_words": 8, "batch": 5, "global_step": 6, "why": "", "from_batch": 7,
    }  # fmt: skip


def test_rolling_mean_over_the_window_decides(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, threshold=0.8, patience=1, min_steps=0, window=2)

    trainer.batch([cb], [[1.0, 1.0]], [4])  # rolling mean 1.0
    assert trainer.datamodule.moves == [(1, 2)]
    trainer.batch([cb], [[0.0, 0.0]], [4])  # the in-flight batch at 4 words: not counted at 8
    for rewards in ([1.0, 1.0], [0.4, 0.4]):  # at 8 words: means 1.0, then (1.0 + 0.4) / 2 = 0.7
        trainer.batch([cb], [rewards], [8])
    assert len(trainer.datamodule.moves) == 2  # the first 8-word batch alone already held 1.0 >= 0.8


def test_no_advance_before_min_steps(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, threshold=0.5, patience=1, min_steps=4)

    for _ in range(3):
        trainer.batch([cb], [GOOD], [4])
    assert trainer.datamodule.moves == [] and cb.curriculum.state.above == 3
    trainer.batch([cb], [GOOD], [4])
    assert trainer.datamodule.moves == [(1, 5)]


def test_thresholds_differ_per_stage_and_batches_of_another_stage_do_not_count(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, threshold=[0.5, 0.95, 0.9], patience=1, min_steps=[0, 2, 0])

    trainer.batch([cb], [BAD], [4])  # mean 0.35 < 0.5
    trainer.batch([cb], [[0.5, 0.6]], [4])  # mean 0.55 >= 0.5: move to 8 words
    trainer.batch([cb], [[1.0, 1.0]], [4])  # fetched before the move: ignored
    assert cb.curriculum.state.steps == 0
    trainer.batch([cb], [GOOD, [1.0, 1.0]], [8, 4])  # 8-word rows 0.95 (the replayed 4-word row is not counted)
    assert trainer.logged["curriculum/reward"] == pytest.approx(0.95)
    trainer.batch([cb], [[0.9, 0.9]], [8])  # min_steps reached but 0.9 < 0.95
    assert [index for index, _ in trainer.datamodule.moves] == [1]
    trainer.batch([cb], [[1.0, 1.0]], [8])
    assert [index for index, _ in trainer.datamodule.moves] == [1, 2]
    assert trainer.logged["curriculum/stage_words"] == 8.0


def test_last_stage_learned_marks_done_and_stops_when_asked(tmp_path):
    trainer = _Trainer(tmp_path, stages=(4,))
    cb = _curriculum(trainer, threshold=0.5, patience=1, min_steps=0, stop_when_done=True)

    trainer.batch([cb], [GOOD], [4])

    assert cb.curriculum.state.done and trainer.should_stop and trainer.datamodule.moves == []
    assert cb.curriculum.state.history[-1]["kind"] == "done"


def test_validation_score_is_also_required_when_configured(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, threshold=0.5, patience=1, min_steps=0, val_threshold=0.7)

    trainer.batch([cb], [GOOD], [4])
    trainer.callback_metrics = {"val/alignment_4w": torch.tensor(0.6), "val/alignment_8w": torch.tensor(0.9)}
    cb.on_validation_end(trainer, trainer.module)
    trainer.batch([cb], [GOOD], [4])
    assert trainer.datamodule.moves == []
    trainer.callback_metrics["val/alignment_4w"] = torch.tensor(0.75)
    cb.on_validation_end(trainer, trainer.module)
    trainer.batch([cb], [GOOD], [4])
    assert (
        trainer.datamodule.moves == [(1, 4)] and cb.curriculum.state.val_score is None
    )  # a new length needs a new score


def test_a_validation_that_reaches_warm_start_until_ends_the_warm_start_from_the_batch_after_next(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, sft_steps=100, warm_start_until=0.5)
    trainer.datamodule.batches_run, trainer.global_step = 30, 30  # 30 warm-start batches ran, index 30 is fetched

    trainer.callback_metrics = {"val/alignment_4w": torch.tensor(0.45)}
    cb.on_validation_end(trainer, trainer.module)
    assert cb.curriculum.warm_start(31)
    trainer.callback_metrics = {"val/alignment_4w": torch.tensor(0.5)}
    cb.on_validation_end(trainer, trainer.module)
    assert cb.curriculum.warm_start(30) and not cb.curriculum.warm_start(31)


def test_collapse_raises_the_temperature_then_stops_with_a_message(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(
        trainer, threshold=0.9, patience=100, collapse_share=0.5, collapse_patience=2, temperature_step=0.25,
        max_temperature=1.5, max_collapse_responses=5,
    )  # fmt: skip

    for _ in range(2):
        trainer.batch([cb], [STUCK, GOOD], [4, 4])  # half the groups stuck: a collapsed batch
    assert trainer.module.temperature == 1.25 and trainer.module.sampling.temperature == 1.0  # the configured one
    for _ in range(2):
        trainer.batch([cb], [STUCK, [0.3, 0.3]], [4, 4])
    assert trainer.module.temperature == 1.5
    assert not trainer.should_stop
    for _ in range(2):
        trainer.batch([cb], [STUCK, STUCK], [4, 4])

    assert trainer.should_stop
    assert "collapse at 4 words" in cb.curriculum.state.stopped and "max_temperature=1.5" in cb.curriculum.state.stopped
    assert [h["kind"] for h in cb.curriculum.state.history] == ["raise_temperature", "raise_temperature", "stop"]


def test_solved_groups_are_not_collapse(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, threshold=1.0, patience=100, collapse_share=0.5, collapse_patience=1)

    for _ in range(3):
        trainer.batch([cb], [[1.0, 1.0], [1.0, 1.0]], [4, 4], completions=["a b"] * 4)  # identical and right

    assert cb.curriculum.state.history == [] and trainer.logged["curriculum/zero_std_share"] == 1.0
    assert trainer.logged["curriculum/stuck_share"] == 0.0 and trainer.logged["curriculum/distinct_completions"] == 1


def test_collapse_steps_back_a_stage_and_stops_at_the_first(tmp_path):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, threshold=0.5, patience=1, min_steps=0, collapse_patience=2, on_collapse="step_back")

    trainer.batch([cb], [GOOD], [4])  # -> 8 words from batch index 2
    trainer.batch([cb], [GOOD], [4])  # in flight
    for _ in range(2):
        trainer.batch([cb], [STUCK], [8])
    assert trainer.datamodule.moves == [(1, 2), (0, 5)] and cb.curriculum.state.stage_index == 0
    trainer.batch([cb], [STUCK], [8])  # in flight at 8 words
    for _ in range(2):
        trainer.batch([cb], [STUCK], [4])

    assert trainer.should_stop and "no earlier stage" in cb.curriculum.state.stopped
    assert [h["kind"] for h in cb.curriculum.state.history] == ["advance", "step_back", "stop"]


def test_collapse_stop_response(tmp_path, capsys):
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, collapse_patience=3, on_collapse="stop")

    for _ in range(3):
        trainer.batch([cb], [STUCK], [4])

    assert trainer.should_stop and "on_collapse is 'stop'" in cb.curriculum.state.stopped
    assert capsys.readouterr().err.splitlines() == [f"warning: {cb.curriculum.state.stopped}"]  # one line, no source


def test_a_stop_is_worded_with_the_settings_that_go_on_from_the_exported_stage(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setattr(CurriculumCallback, "_export", lambda *args: None)  # the folder is named, not written
    trainer = _Trainer(tmp_path)
    cb = _curriculum(trainer, export=True, threshold=0.5, patience=1, min_steps=0, plateau_steps=2)

    trainer.batch([cb], [GOOD], [4])  # -> 8 words from batch index 2
    trainer.batch([cb], [GOOD], [4])  # in flight
    for _ in range(3):  # 0.35 sets the best at 8 words; two batches without a gain stop the run
        trainer.batch([cb], [BAD], [8])

    stopped = (
        "curriculum: stopping, no gain over 0.01 in the rolling reward at 8 words for 2 batches, the plateau_steps "
        "(now 0.350, best 0.350). What to change: resume from the last learned stage with a smaller step between "
        f"lengths: add `--model.base.init_from {tmp_path}/stages/4words --data.sft_steps 0 --data.stages "
        "'[6, 8, 16]'` to this run's fit command; or a supervised warm-start at 8 words (data.sft_stages, "
        "data.sft_steps)."
    )
    assert trainer.should_stop and cb.curriculum.state.stopped == stopped
    assert cb.curriculum.state.history[-1] == {
        "kind": "stop", "from_words": 8, "to_words": 8, "batch": 4, "global_step": 5, "why": stopped,
    }  # fmt: skip
    assert capsys.readouterr().err.splitlines() == [f"warning: {stopped}"]
    assert f"curriculum stop: 8 -> 8 words at step 5 ({stopped})" in caplog.text


WARM_START = "a supervised warm-start at 4 words (data.sft_stages, data.sft_steps)"


@pytest.mark.parametrize(
    ("step", "others", "exports", "what_to_change"),
    [
        (
            SmallerStep([2, 4, 8, 16], {}, learned_words=None), (WARM_START,), "run/stages",
            "rerun with a smaller step between lengths: add `--data.stages '[2, 4, 8, 16]'` to this run's fit "
            f"command; or {WARM_START}.",
        ),
        (
            SmallerStep([37, 50, 100], {"threshold": [0.85, 0.85, 0.8]}, learned_words=25), (WARM_START,), "run/stages",
            "resume from the last learned stage with a smaller step between lengths: add `--model.base.init_from "
            "run/stages/25words --data.sft_steps 0 --data.stages '[37, 50, 100]' --data.curriculum.threshold "
            "'[0.85, 0.85, 0.8]'` to this run's fit command (the per-stage lists rewritten for these stages; one "
            f"value applies to every stage); or {WARM_START}.",
        ),
        (
            SmallerStep([6, 8, 16], {"max_stage_steps": [5, 5, None]}, learned_words=4),
            ("a larger max_stage_steps if the reward was still rising", WARM_START), None,
            "resume from the last learned stage with a smaller step between lengths: add `--model.base.init_from "
            "<the 4-word stage's weights> --data.sft_steps 0 --data.stages '[6, 8, 16]' "
            "--data.curriculum.max_stage_steps '[5, 5, null]'` to this run's fit command (the per-stage lists "
            "rewritten for these stages; one value applies to every stage); or a larger max_stage_steps if the "
            f"reward was still rising; or {WARM_START}.",
        ),
        (None, (WARM_START,), "run/stages", f"{WARM_START}."),
    ],
)  # fmt: skip
def test_stop_message_words_the_advice_as_one_line_with_the_settings_to_add(step, others, exports, what_to_change):
    advice = StopAdvice("no gain at 4 words", step, others)

    said = stop_message(advice, exports)
    assert said == f"curriculum: stopping, no gain at 4 words. What to change: {what_to_change}"


def test_state_round_trips_through_a_checkpoint_and_decides_the_same(tmp_path):
    trainer = _Trainer(tmp_path)
    kwargs = {"threshold": 0.5, "patience": 3, "min_steps": 0, "collapse_patience": 2, "window": 2}
    cb = _curriculum(trainer, **kwargs)
    for rewards in (GOOD, STUCK, STUCK, GOOD, GOOD, GOOD):  # a temperature raise; rolling means 0.475, 0.95, 0.95
        trainer.batch([cb], [rewards], [4])
    saved = cb.curriculum.state_dict()
    torch.save({"curriculum": saved}, tmp_path / "state.pt")

    assert trainer.module.temperature == 1.25 and "temperature" not in saved  # the module's, checkpointed by it

    restored = _curriculum(trainer, **kwargs)
    trainer.datamodule.curriculum.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False)["curriculum"])

    assert trainer.datamodule.curriculum.state_dict() == saved and trainer.module.temperature == 1.25
    trainer.batch([restored], [GOOD], [4])
    assert trainer.datamodule.moves == [(1, 8)]  # the third batch at 0.95


def test_a_resume_samples_at_the_raised_temperature_unless_the_command_asks_for_another():
    from interleave_model.model.checkpoint import resumed_temperature
    from interleave_model.model.migrations import migrate

    hparams = {"sampling": {"temperature": 1.0, "num_generations": 2}}
    saved = {"temperature": 1.25, "hyper_parameters": hparams}  # a curriculum raised it from the configured 1.0
    assert resumed_temperature(saved, configured=1.0) == 1.25
    assert resumed_temperature(saved, configured=0.7) == 0.7  # `--model.sampling.temperature 0.7`: the user's
    # where older checkpoints kept it: the curriculum's state (the DataModule's entry, earlier the callback's), flat
    # settings; migrated on load (`InterleaveGRPO.on_load_checkpoint`)
    flat = {"temperature": 1.0, "learning_rate": 0.001}
    in_datamodule = {"InterleaveDataModule": {"curriculum": {"temperature": 1.5}}, "hyper_parameters": flat}
    in_callback = {"callbacks": {"CurriculumCallback": {"temperature": 1.5}}, "hyper_parameters": dict(flat)}
    for old in (in_datamodule, in_callback):
        migrate(old)
    assert resumed_temperature(in_datamodule, 1.0) == resumed_temperature(in_callback, 1.0) == 1.5
    none_stored = {"hyper_parameters": flat}
    migrate(none_stored)
    assert resumed_temperature(none_stored, 1.0) == 1.0  # none stored: the configured one


def test_replay_share_and_a_move_from_a_given_batch(make_datamodule):
    dm = make_datamodule(None, stages=(4, 8), batch_size=4, replay_fraction=0.5)

    dm.curriculum.move(1, from_batch=3)
    lengths = [sorted(e.n_words for e in dm.sample_train_batch(k)[1]) for k in range(6)]

    assert lengths[:3] == [[4, 4, 4, 4]] * 3
    assert lengths[3:] == [[4, 4, 8, 8]] * 3  # half of each batch replays the earlier stage
    assert dm.state_dict()["curriculum"]["moves"] == [] and dm.curriculum.state.drawn_index == 1


def test_a_pending_move_is_saved_and_restored(make_datamodule):
    dm = make_datamodule(None, stages=(4, 8))
    dm.curriculum.move(1, from_batch=5)
    state = dm.state_dict()
    assert (state["curriculum"]["drawn_index"], state["curriculum"]["moves"]) == (0, [[5, 1]])

    other = make_datamodule(None, stages=(4, 8))
    other.load_state_dict(state)
    assert [other.sample_train_batch(k)[1][0].n_words for k in (4, 5)] == [4, 8]


def test_sample_dump_writes_best_and_worst_every_n_batches_and_appends(tmp_path):
    trainer = _Trainer(tmp_path)
    dump = SampleDump(every_n_steps=2)
    dump.setup(trainer, trainer.module, "fit")
    completions = ["t0 u0", "t0", "nothing here", "t1 u1"]

    trainer.batch([dump], [[1.0, 0.5], [0.0, 1.0]], [1, 1], completions)
    assert not (tmp_path / "samples.log").exists()
    trainer.batch([dump], [[1.0, 0.5], [0.0, 1.0]], [1, 1], completions)
    trainer.batch([dump], [[1.0, 0.5], [0.0, 1.0]], [1, 1], completions)
    trainer.batch([dump], [[0.2, 0.5], [0.0, 0.3]], [1, 1], completions)

    lines = (tmp_path / "samples.log").read_text().splitlines()
    heads = [line for line in lines if line.startswith("===")]
    assert heads == [
        "=== step 2 best: reward 1.000, first error at word 2/2, 1 words",
        "=== step 2 worst: reward 0.000, first error at word 0/2, 1 words",
        "=== step 4 best: reward 0.500, first error at word 1/2, 1 words",
        "=== step 4 worst: reward 0.000, first error at word 0/2, 1 words",
    ]
    assert lines[1:4] == ["prompt: prompt 0", "target: t0 u0", "completion: t0 u0"]


def test_sample_dump_shows_each_text_whole_in_tensorboard_with_the_departure_marked(tmp_path):
    trainer = _Trainer(tmp_path)
    trainer.loggers = [TensorBoardLogger(tmp_path, name="tb", version=0)]
    dump = SampleDump(every_n_steps=1)
    dump.setup(trainer, trainer.module, "fit")

    trainer.batch([dump], [[1.0, 0.5]], [1], ["t0 u0", "t0 x0"])
    trainer.loggers[0].experiment.flush()

    events = EventAccumulator(str(tmp_path / "tb" / "version_0")).Reload()
    (text,) = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("samples/text_summary")]
    assert "\n\n    t0 u0\n\n" in text  # the target, as a code block of its own
    assert text.endswith("\n\n    t0 ⟦x0⟧")  # the worst completion, its second word marked


@pytest.fixture
def tiny(make_module):
    module = make_module()
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return module


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _learn_first_stage(tmp_path, module) -> Path:
    """Play one learned batch through a CurriculumCallback with export on; returns the stage folder it wrote."""
    trainer = _Trainer(tmp_path)
    module.log_dict = trainer.module.log_dict
    trainer.module = module
    cb = _curriculum(trainer, threshold=0.5, patience=1, min_steps=0, export=True)
    trainer.batch([cb], [GOOD], [4])
    assert trainer.datamodule.moves == [(1, 2)]
    return tmp_path / "stages" / "4words"


def test_stage_end_exports_a_full_model_that_loads_with_from_pretrained(tmp_path, tiny):
    folder = _learn_first_stage(tmp_path, tiny)

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tiny.tokenizer("A: in the B: of Interleave:", return_tensors="pt")["input_ids"]
    assert tokenizer("A: in the B: of Interleave:")["input_ids"] == ids[0].tolist()
    assert torch.equal(_logits(model, ids), _logits(tiny.policy, ids))


def test_stage_end_exports_a_lora_adapter_that_loads_with_peft(tmp_path, make_module):
    from peft import PeftModel

    module = make_module(lora=LoraSettings(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
    folder = _learn_first_stage(tmp_path, module)

    assert (folder / "adapter_config.json").exists() and not (folder / "model.safetensors").exists()
    base = make_module().policy  # the same seeded tiny model, without an adapter
    loaded = PeftModel.from_pretrained(base, folder)
    ids = module.tokenizer("A: in B: of Interleave:", return_tensors="pt")["input_ids"]
    module.policy.eval()
    assert torch.allclose(_logits(loaded, ids), _logits(module.policy, ids))


def test_init_from_a_checkpoint_a_model_folder_or_an_adapter(tmp_path, tiny, make_module):
    torch.save({"state_dict": {f"policy.{k}": v for k, v in tiny.policy.state_dict().items()}}, tmp_path / "a.ckpt")
    export(tiny, tmp_path / "full")  # the layout of a stage folder
    lora = make_module(lora=LoraSettings(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        next(p for n, p in lora.policy.named_parameters() if "lora_B" in n).add_(0.5)
    export(lora, tmp_path / "adapter")

    for source in ("a.ckpt", "full"):
        started = make_module(base={"init_from": str(tmp_path / source)})
        assert all(torch.equal(v, tiny.policy.state_dict()[k]) for k, v in started.policy.state_dict().items())
    continued = make_module(
        lora=LoraSettings(r=2, target_modules=["q_proj"]), base={"init_from": str(tmp_path / "adapter")}
    )
    assert all(torch.equal(v, lora.policy.state_dict()[k]) for k, v in continued.policy.state_dict().items())
    with pytest.raises(PolicyError, match="set model.lora"):
        load_initial_weights(make_module().policy, tmp_path / "adapter")
    with pytest.raises(PolicyError, match="does not exist"):
        load_initial_weights(tiny.policy, tmp_path / "missing")


# ---------------------------------------------------------------- dynamic sampling


def _trajectory(rewards: list[float], prompt_width: int, width: int, first_id: int = 10) -> Trajectory:
    """Rows whose prompt has `prompt_width` real tokens and whose completion has `width` tokens, ids numbered."""
    n = len(rewards)
    prompt = torch.arange(first_id, first_id + n * prompt_width).view(n, prompt_width)  # [N, Lp]
    completion = torch.arange(first_id + 100, first_id + 100 + n * width).view(n, width)  # [N, C]
    roll = Rollout(
        prompt, torch.ones_like(prompt), completion, torch.ones_like(completion), torch.zeros(n, dtype=torch.bool),
        [f"text {first_id + i}" for i in range(n)],
    )  # fmt: skip
    ids = torch.cat([prompt, completion], dim=1)
    r = torch.tensor(rewards)
    return Trajectory(ids, torch.ones_like(ids), completion, torch.ones_like(completion), None, completion.float(), r,
                      r - r.view(-1, G).mean(1).repeat_interleave(G), roll)  # fmt: skip


def _refill(original: Trajectory, refills: list[Trajectory], max_rounds: int):
    """`refill` with a stand-in generator popping `refills` and a draw that records what it was asked."""
    asked = []

    def draw(round_, n):
        asked.append((round_, n))
        return {"prompt_ids": torch.zeros(n, 1)}

    out, stats = refill(original, lambda batch: refills.pop(0), draw, G, max_rounds, pad_token_id=0)
    return out, stats, asked


def test_dynamic_sampling_drops_flat_groups_and_refills_them(tmp_path):
    original = _trajectory([0.0, 0.0, 0.2, 0.4, 1.0, 1.0], prompt_width=2, width=3)  # groups: flat, varied, flat
    refills = [_trajectory([0.1, 0.2, 0.5, 0.5], 1, 2, first_id=50), _trajectory([0.3, 0.1, 0.7, 0.9], 3, 4, 70)]
    out, stats, asked = _refill(original, refills, max_rounds=3)

    # round 0 refills the 2 missing groups and finds 1 varied; round 1 asks for 1 and keeps the first of two
    assert asked == [(0, 2), (1, 1)]
    assert stats == {"train/dynamic_dropped_groups": 3.0, "train/dynamic_rounds": 2.0, "train/dynamic_kept_groups": 3.0}
    assert out.rollout.texts == ["text 12", "text 13", "text 50", "text 51", "text 70", "text 71"]
    assert out.input_ids.shape == (6, 3 + 4) and out.completion_ids.shape == (6, 4)
    assert out.input_ids[2].tolist() == [0, 0, 50, 150, 151, 0, 0]  # prompt padded left, completion right
    assert out.attention_mask[2].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert out.ref_logprobs[2].tolist() == [150.0, 151.0, 0.0, 0.0] and out.old_logprobs is None
    assert torch.equal(out.rewards, torch.tensor([0.2, 0.4, 0.1, 0.2, 0.3, 0.1]))


def test_dynamic_sampling_stops_at_the_cap_and_keeps_the_batch_size(tmp_path):
    original = _trajectory([0.0, 0.0, 0.0, 0.0], 1, 1)
    out, stats, asked = _refill(original, [_trajectory([0.5, 0.5], 1, 1) for _ in range(2)], max_rounds=2)

    assert out is original and len(asked) == 2  # nothing varied: the batch itself, after two refill rounds
    assert stats == {"train/dynamic_dropped_groups": 4.0, "train/dynamic_rounds": 2.0, "train/dynamic_kept_groups": 0.0}

    refills = [_trajectory([0.5, 0.5], 1, 1), _trajectory([0.2, 0.7, 0.1, 0.1], 1, 1, first_id=40)]
    out, stats, asked = _refill(original, refills, max_rounds=2)
    assert out.rollout.texts == ["text 40", "text 41", "text 10", "text 11"]  # one varied, one flat to fill up


def test_select_and_concat_keep_rows_whole(tmp_path):
    t = _trajectory([0.0, 1.0, 0.5, 0.5], 2, 2)
    picked = select_groups(t, torch.tensor([False, True]), G)
    assert picked.rollout.texts == ["text 12", "text 13"] and torch.equal(picked.rewards, torch.tensor([0.5, 0.5]))
    assert concat([picked], 0) is picked


class _EvenTargetsFlat(RewardFunction):
    """Varied rewards for targets of odd character length, all-zero groups for even ones."""

    def __call__(self, completions, targets, truncated):
        return [len(c) / 100 if len(t) % 2 else 0.0 for c, t in zip(completions, targets, strict=True)]


def test_dynamic_sampling_trains_under_a_trainer(make_module, make_datamodule):
    module = make_module(rewards=[_EvenTargetsFlat()], dynamic_sampling=DynamicSampling(max_rounds=2))
    dm = make_datamodule(module.tokenizer, batch_size=4)
    logged = {}

    class Keep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.update({k: float(v) for k, v in trainer.callback_metrics.items() if "dynamic" in k})

    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[Keep()],
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)

    assert trainer.global_step == 2 and logged["train/dynamic_kept_groups"] <= 4
    assert logged["train/dynamic_rounds"] <= 2

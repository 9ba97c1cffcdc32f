from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from interleave_data.cli import main
from interleave_data.corpus import CorpusError
from interleave_data.datamodule import InterleaveDataModule
from interleave_data.prompts import format_prompt
from tests.data.helpers import build_tokenizer, numbered_texts, write_jsonl

STAGES = [10, 25, 50]


def make_dm(tmp_path, tokenizer=None, **kwargs) -> InterleaveDataModule:
    args = {"stages": STAGES, "train_pairs": 40, "val_pairs": 6, "test_pairs": 5, "cache_dir": str(tmp_path / "cache")}
    dm = InterleaveDataModule(**{**args, **kwargs, "tokenizer": tokenizer})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_collate_left_pads_and_tokenizes_targets_once(tmp_path, tokenizer):
    dm = make_dm(tmp_path, tokenizer, template="compact")
    examples = [dm.examples(10, "val")[0], dm.examples(25, "val")[0], dm.examples(50, "val")[1]]

    batch = dm.collate(examples, "eval")

    ids, mask = batch["prompt_ids"], batch["prompt_mask"]  # [B, P]
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape and ids.shape[0] == 3
    for row, example in enumerate(examples):
        expected = tokenizer(format_prompt(example.a, example.b, "compact"))["input_ids"]
        real = int(mask[row].sum())
        assert real == len(expected)
        assert mask[row, ids.shape[1] - real :].all() and not mask[row, : ids.shape[1] - real].any()
        assert ids[row, ids.shape[1] - real :].tolist() == expected
        assert (ids[row, : ids.shape[1] - real] == tokenizer.pad_token_id).all()
    assert batch["targets"] == [e.target for e in examples]
    assert batch["target_ids"] == [tokenizer(e.target, add_special_tokens=False)["input_ids"] for e in examples]
    assert batch["ids"] == [e.id for e in examples] and batch["n_words"] == [10, 25, 50]
    assert batch["prompts"] == [format_prompt(e.a, e.b, "compact") for e in examples] and batch["phase"] == "eval"
    # the texts the fragments come from: a held-out score's standard error is over them
    assert (batch["text_a"], batch["text_b"]) == ([e.text_a for e in examples], [e.text_b for e in examples])


def test_chat_template_prompts_get_no_second_bos(tmp_path):
    chat = "{% for m in messages %}[BOS] {{ m.content }}{% endfor %}{% if add_generation_prompt %} <bot>{% endif %}"
    dm = make_dm(tmp_path, build_tokenizer({"A:"}, chat), template="compact")

    batch = dm.collate(dm.examples(10, "val")[:2], "eval")

    assert all(p.startswith("[BOS] A:") and p.endswith("<bot>") for p in batch["prompts"])
    assert ((batch["prompt_ids"] == 2).sum(dim=1) == 1).all()  # [BOS] has id 2


def test_collate_without_tokenizer_says_how_to_give_one(tmp_path):
    dm = make_dm(tmp_path)

    with pytest.raises(RuntimeError, match=r"InterleaveDataModule\(tokenizer=model.tokenizer\)"):
        next(iter(dm.train_dataloader()))


def test_stage_switch_takes_effect_on_the_next_batch(tmp_path, tokenizer):
    dm = make_dm(tmp_path, tokenizer, batch_size=3)
    stream = iter(dm.train_dataloader())

    first = next(stream)
    dm.curriculum.move(2)
    second = next(stream)

    assert first["n_words"] == [10] * 3 and first["phase"] == "grpo"
    assert second["n_words"] == [50] * 3 and dm.curriculum.stage_words == 50


def test_replay_share_comes_from_earlier_stages_only(tmp_path, tokenizer):
    dm = make_dm(tmp_path, tokenizer, batch_size=8, replay_fraction=0.25)
    dm.curriculum.move(2)

    batches = [dm.sample_train_batch(k)[1] for k in range(40)]

    for batch in batches:
        counts = Counter(e.n_words for e in batch)
        assert counts[50] == 6 and counts[10] + counts[25] == 2
    replayed = Counter(e.n_words for batch in batches for e in batch if e.n_words != 50)
    assert replayed[10] > 20 and replayed[25] > 20  # uniform over the two earlier stages
    dm.curriculum.move(0)
    assert all(e.n_words == 10 for k in range(10) for e in dm.sample_train_batch(k)[1])  # nothing to replay


def test_sft_batches_then_grpo_batches_from_disjoint_halves(tmp_path, tokenizer):
    dm = make_dm(tmp_path, tokenizer, batch_size=4, sft_batch_size=6, sft_steps=5)
    stream = iter(dm.train_dataloader())

    batches = [next(stream) for _ in range(60)]

    assert [b["phase"] for b in batches] == ["sft"] * 5 + ["grpo"] * 55
    assert all(len(b["ids"]) == 6 for b in batches[:5]) and all(len(b["ids"]) == 4 for b in batches[5:])
    sft = {i for b in batches[:5] for i in b["ids"]}
    grpo = {i for b in batches[5:] for i in b["ids"]}
    train = {e.id for e in dm.examples(10, "train")}
    assert sft <= train and grpo <= train and not sft & grpo
    assert len(grpo) <= len(train) // 2 + 1 and len(grpo) > len(train) // 4


def test_sft_stages_mix_their_lengths_in_the_warm_start_only(tmp_path):
    dm = make_dm(tmp_path, stages=[10, 25], sft_stages=[3, 4, 10], sft_batch_size=8, sft_steps=50)

    sft = [e for k in range(50) for e in dm.sample_train_batch(k)[1]]
    grpo = [e for k in range(50, 80) for e in dm.sample_train_batch(k)[1]]

    counts = {n: sum(e.n_words == n for e in sft) for n in (3, 4, 10)}
    assert sum(counts.values()) == len(sft) == 400 and min(counts.values()) > 90  # about a third each
    assert {e.id for e in sft} <= {e.id for n in (3, 4, 10) for e in dm._train_pool(n, "sft")}
    assert {e.n_words for e in grpo} == {10}  # GRPO stays at the stage; 3 and 4 are not curriculum stages
    assert len(dm.examples(3, "val")) == 0  # nor evaluation lengths


def test_without_warm_start_grpo_draws_from_all_train_pairs(tmp_path):
    dm = make_dm(tmp_path, batch_size=4)

    seen = {e.id for k in range(100) for e in dm.sample_train_batch(k)[1]}

    assert seen == {e.id for e in dm.examples(10, "train")}


def test_stream_is_seeded_per_batch_rank_and_resumes_at_consumed_batches(tmp_path):
    dm = make_dm(tmp_path, batch_size=4)

    assert dm.sample_train_batch(3) == dm.sample_train_batch(3)
    assert dm.sample_train_batch(3) != dm.sample_train_batch(4)
    assert dm.sample_train_batch(3, rank=0) != dm.sample_train_batch(3, rank=1)
    dm.load_state_dict(dm.state_dict() | {"batches_run": 10})  # a checkpoint saved after 10 batches
    dm.trainer = SimpleNamespace(global_rank=1, global_step=3)
    assert next(iter(dm.train_dataloader().dataset)) == (10, *dm.sample_train_batch(10, rank=1))


def test_the_count_moves_as_each_training_batch_goes_to_its_step(tmp_path, tokenizer):
    dm = make_dm(tmp_path, tokenizer, batch_size=4)
    stream = iter(dm.train_dataloader())
    first, second = next(stream), next(stream)  # the loop fetches a batch ahead: drawing one counts nothing
    assert (first["batch_index"], second["batch_index"], dm.batches_run) == (0, 1, 0)
    assert dm.on_before_batch_transfer(first, 0) is first and dm.batches_run == 1
    dm.on_before_batch_transfer({"phase": "eval"}, 0)  # a held-out batch is not counted
    assert dm.batches_run == 1 and dm.state_dict()["batches_run"] == 1


def test_a_training_batch_carries_where_the_phases_lie_and_its_refill_draw(tmp_path, tokenizer):
    # sft_steps 3; a check before batch 1 is drawn ends the warm start there, as warm_start_until does: batch 0,
    # drawn before it, is a warm-start batch carrying the start planned, batch 1 a GRPO one carrying the new start
    dm = make_dm(tmp_path, tokenizer, batch_size=2, sft_steps=3)
    stream = iter(dm.train_dataloader())
    first = next(stream)
    dm.curriculum.state.warm_end = 1
    second = next(stream)
    assert [(b["phase"], b["sft_steps"], b["grpo_start"]) for b in (first, second)] == [("sft", 3, 3), ("grpo", 3, 1)]
    assert "refill" not in first  # a warm-start batch is never refilled
    # the refill draws the batch's own seeded stream (its index, this rank) at its longest length
    assert second["refill"](0, 2)["ids"] == dm.sample_refill(1, 0, 2, max(second["n_words"]))["ids"]


def test_a_checkpoint_without_the_count_resumes_at_the_global_step(tmp_path):
    dm = make_dm(tmp_path, batch_size=4)
    dm.load_state_dict({"curriculum": dm.curriculum.state_dict()})  # written before the count was kept
    dm.trainer = SimpleNamespace(global_rank=0, global_step=7)
    assert dm.batches_run == 7 and next(iter(dm.train_dataloader().dataset))[0] == 7


def test_state_dict_round_trip(tmp_path):
    dm = make_dm(tmp_path)
    dm.curriculum.move(2)
    other = InterleaveDataModule(stages=STAGES)

    other.load_state_dict(dm.state_dict())

    assert other.curriculum.state == dm.curriculum.state and other.curriculum.stage_words == 50
    with pytest.raises(ValueError, match="stage index"):
        other.curriculum.move(3)


def test_eval_loaders_cover_each_length_in_order(tmp_path, tokenizer):
    dm = make_dm(tmp_path, tokenizer, eval_batch_size=4, eval_stages=[10, 50])

    val, test = dm.val_dataloader(), dm.test_dataloader()

    assert dm.eval_lengths == [10, 50] and len(val) == len(test) == 2
    for loaders, count in ((val, 6), (test, 5)):
        for loader, n in zip(loaders, dm.eval_lengths, strict=True):
            batches = list(loader)
            assert sum(len(b["ids"]) for b in batches) == count
            assert all(b["phase"] == "eval" and set(b["n_words"]) == {n} for b in batches)
    predicted = [i for b in dm.predict_dataloader() for i in b["ids"]]
    assert predicted == [e.id for n in (10, 50) for e in dm.examples(n, "test")]
    assert not {e.text_a for e in dm.examples(50, "test")} & {e.text_a for e in dm.examples(50, "train")}


def test_folder_and_on_the_fly_give_the_same_examples(tmp_path):
    corpus = write_jsonl(tmp_path / "texts.jsonl", numbered_texts(40, 50))
    params = ["--stages", "10", "25", "50", "--train-pairs", "40", "--val-pairs", "6", "--test-pairs", "5"]
    assert main(["generate", "--output-dir", str(tmp_path / "ds"), "--corpus", corpus, *params, "--seed", "3"]) == 0

    on_the_fly = make_dm(tmp_path, corpus=[corpus], seed=3)
    from_folder = make_dm(tmp_path, dataset_dir=str(tmp_path / "ds"), seed=3)
    smaller = make_dm(tmp_path, corpus=[corpus], seed=3, train_pairs=10)
    smaller_folder = make_dm(tmp_path, dataset_dir=str(tmp_path / "ds"), seed=3, train_pairs=10)

    for n in STAGES:
        for split in ("train", "val", "test"):
            assert from_folder.examples(n, split) == on_the_fly.examples(n, split) != []
        assert smaller_folder.examples(n, "train") == smaller.examples(n, "train")
    with pytest.raises(CorpusError, match="has 40 examples, train_pairs asks for 41"):
        make_dm(tmp_path, dataset_dir=str(tmp_path / "ds"), train_pairs=41)


def test_cache_is_rebuilt_when_the_corpus_file_changes(tmp_path):
    path = tmp_path / "texts.jsonl"
    write_jsonl(path, numbered_texts(40, 50, tag="old"))
    before = make_dm(tmp_path, corpus=[str(path)])
    again = make_dm(tmp_path, corpus=[str(path)])

    write_jsonl(path, numbered_texts(40, 50, tag="new"))
    after = make_dm(tmp_path, corpus=[str(path)])

    assert again.examples(10, "train") == before.examples(10, "train")
    assert all(e.a.startswith("new") for e in after.examples(10, "train"))
    assert len(list((tmp_path / "cache" / "interleave_data").iterdir())) == 2


def test_setup_alone_builds_and_examples_need_setup(tmp_path):
    dm = InterleaveDataModule(stages=[10], train_pairs=4, val_pairs=0, test_pairs=2, cache_dir=str(tmp_path))

    with pytest.raises(RuntimeError, match="setup"):
        dm.examples(10, "train")
    dm.setup()

    assert len(dm.examples(10, "train")) == 4 and dm.val_dataloader() == [] and len(dm.test_dataloader()) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": [25, 10]}, "stages must be strictly increasing"),
        ({"stages": [0]}, "stages must be a positive integer"),
        ({"eval_stages": []}, "eval_stages must name at least one length"),
        ({"template": "nope"}, "two_processes"),
        ({"replay_fraction": 1.0}, "replay_fraction"),
        ({"sft_steps": 3, "train_pairs": 1}, "train_pairs >= 2"),
        ({"predict_split": "dev"}, "predict_split"),
        ({"split_fractions": (0.9, 0.2, 0.1)}, "split fractions"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(CorpusError, match=message):
        InterleaveDataModule(**kwargs)


def test_too_few_long_held_out_texts_fail_in_prepare_data(tmp_path):
    corpus = write_jsonl(tmp_path / "texts.jsonl", numbered_texts(40, 10) + ["long " * 100 + "tail"])
    dm = InterleaveDataModule(corpus=[corpus], stages=[10, 100], cache_dir=str(tmp_path))

    with pytest.raises(CorpusError, match="stage 100 words"):
        dm.prepare_data()
    assert not (tmp_path / "interleave_data").exists() or not any((tmp_path / "interleave_data").iterdir())


def _adaptive(**settings):
    from interleave_data.curriculum_types import CurriculumSettings
    from interleave_data.length_schedule import AdaptiveLength

    return CurriculumSettings(adaptive=AdaptiveLength(), **settings)


def test_adaptive_rows_come_from_the_train_texts_at_any_length(tmp_path, tokenizer):
    dm = make_dm(tmp_path, tokenizer, curriculum=_adaptive(), replay_fraction=0.5, batch_size=8)
    dm.curriculum.state.moves = [[0, 1, 37]]  # a length no stage builds
    train_texts = {t.id for t in dm._train_texts}
    held_out = {e.text_a for split in ("val", "test") for n in STAGES for e in dm.examples(n, split)}

    phase, batch = dm.sample_train_batch(0)
    again = dm.sample_train_batch(0)[1]

    assert phase == "grpo" and batch == again  # seeded by the batch index: a resumed run draws the same
    assert [e.n_words for e in batch[:4]] == [37] * 4
    assert all(19 <= e.n_words < 37 for e in batch[4:])  # replayed at [37 / 2, 37)
    assert {e.text_a for e in batch} | {e.text_b for e in batch} <= train_texts
    assert not ({e.text_a for e in batch} | {e.text_b for e in batch}) & held_out
    for e in batch:
        assert e.target.split() == [w for pair in zip(e.a.split(), e.b.split(), strict=True) for w in pair]


def test_adaptive_refuses_a_dataset_folder_and_an_unevaluated_gate(tmp_path):
    with pytest.raises(CorpusError, match="data.curriculum.adaptive trains at any length"):
        make_dm(tmp_path, dataset_dir=str(tmp_path), curriculum=_adaptive())
    with pytest.raises(CorpusError, match=r"gates the milestones \[50\], which are never evaluated"):
        make_dm(tmp_path, eval_stages=[10, 25], curriculum=_adaptive(val_threshold=0.9))


def test_validation_test_and_prediction_take_any_schedule_and_no_checkpointed_one(tmp_path):
    """Gates are fit's check and the schedule is fit's state: a held-out run of an adaptive config takes lengths its
    gates never see, and a fixed-stage checkpoint's schedule is left unread (fit refuses it)."""

    from interleave_data.curriculum import Curriculum

    dm = InterleaveDataModule(stages=STAGES, eval_stages=[10, 25], curriculum=_adaptive(val_threshold=0.9),
                              train_pairs=40, val_pairs=6, test_pairs=5, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.prepare_data()
    for stage in ("validate", "test", "predict"):
        dm.setup(stage)
    fixed = {"curriculum": Curriculum(tuple(STAGES)).state_dict(), "batches_run": 7}
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="validate"))
    dm.load_state_dict(fixed)
    assert dm.curriculum.state.level is not None and dm.batches_run != 7  # the config's own schedule, untouched
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"))
    with pytest.raises(CorpusError, match="trained on fixed stages"):
        dm.load_state_dict(fixed)
    with pytest.raises(CorpusError, match=r"gates the milestones \[50\]"):
        dm.setup("fit")


def test_adaptive_refuses_a_last_milestone_longer_than_the_corpus_before_training(tmp_path):
    corpus = write_jsonl(tmp_path / "short.jsonl", numbered_texts(30, 60))
    with pytest.raises(CorpusError, match="stage 80 words"):
        make_dm(tmp_path, corpus=[str(corpus)], stages=[10, 80], curriculum=_adaptive())

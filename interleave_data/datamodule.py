"""InterleaveDataModule: the curriculum's stream, the SFT -> GRPO warm-start, and tokenized prompt batches."""

import random
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from interleave_data.cache import build_cache, cache_path, load_cache
from interleave_data.corpus import CorpusError, Text, load_corpus
from interleave_data.curriculum import Curriculum
from interleave_data.curriculum_types import CurriculumSettings, check_lengths
from interleave_data.folder import read_split
from interleave_data.held_out import HeldOutBatches, checked_lengths, deciding_lengths, stages_passed
from interleave_data.pairs import SPLITS, Example, Split, check_fractions, draw_example, split_texts
from interleave_data.prompts import TEMPLATES, TemplateName, adds_special_tokens, format_prompt


class InterleaveDataModule(LightningDataModule):
    """Serves interleaving tasks for the current curriculum stage and held-out tasks at every evaluation length.

    Training is an infinite stream: batch ``k`` is drawn from ``random.Random(f"{seed}:train:{k}:{rank}")``, and ``k``
    resumes at the number of batches already run, so a resumed run continues the same stream. Batches
    ``k < sft_steps`` are supervised warm-start batches from one half of the stage's training pairs (fewer when
    ``curriculum.warm_start_until`` ends the warm-start at a held-out score); later batches
    are GRPO batches from the other half, with a share from earlier stages (replay). Validation and test give one
    loader per evaluation length, for a score-vs-length curve; during fit a validation runs only the lengths whose
    score decides something, and the whole curve after a stage is passed and as fit ends (`held_out_lengths`).

    The curriculum (``self.curriculum``) decides which stage each batch is drawn at and is checkpointed here, once.
    Under a Trainer, Lightning fetches one batch ahead: a stage move made in ``on_train_batch_end`` shows from the
    batch after next.

    Args:
        corpus: Corpus sources (see ``load_corpus``); None means the embedded default.
        dataset_dir: A folder written by ``python -m interleave_data generate``; when given, examples are read from
            it instead of built (the first ``*_pairs`` of each file, which equal an on-the-fly build of that size).
        stages: Curriculum lengths in words per fragment, strictly increasing.
        curriculum: When a stage is learned and how a collapse is answered (``CurriculumCallback`` acts on it).
        train_pairs: Training examples per stage.
        val_pairs: Validation examples per evaluation length.
        test_pairs: Test examples per evaluation length.
        split_fractions: Shares of train / val / test texts.
        seed: Seeds the split, the pairs and the training stream.
        template: Prompt template name (see ``interleave_data.prompts.TEMPLATES``).
        batch_size: Prompts per GRPO batch.
        sft_batch_size: Examples per SFT batch; None means ``batch_size``.
        sft_steps: Number of SFT batches before GRPO starts; 0 skips the warm-start.
        sft_stages: Lengths the warm-start mixes, each example's length drawn uniformly from them; None means the
            current stage only. A mix of lengths teaches an algorithm that carries a little past the longest one,
            which is what lets GRPO climb a curriculum from there (see ``benchmarks/efficacy.py``).
        eval_batch_size: Prompts per validation / test / predict batch.
        replay_fraction: Share of each GRPO batch drawn from earlier stages, in [0, 1).
        eval_stages: Lengths of the validation and test loaders; None means all ``stages``.
        eval_every_length: Run every ``eval_stages`` length at each validation of fit; False runs the lengths that
            decide something and the whole curve after each stage passed and as fit ends (``held_out_lengths``).
        predict_split: Split served by ``predict_dataloader``.
        cache_dir: Root of the Arrow cache; None means the HF datasets cache.
        tokenizer: The model's tokenizer, for prompts and target ids; linked from ``model.tokenizer`` by the CLI,
            not a config key.
    """

    def __init__(
        self,
        corpus: list[str] | None = None,
        dataset_dir: str | None = None,
        stages: Sequence[int] = (10, 25, 50, 100, 200, 500),
        curriculum: CurriculumSettings = CurriculumSettings(),  # noqa: B008 (frozen, so one shared default is safe)
        train_pairs: int = 1000,
        val_pairs: int = 32,
        test_pairs: int = 32,
        split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
        seed: int = 0,
        template: TemplateName = "two_processes",
        batch_size: int = 4,
        sft_batch_size: int | None = None,
        sft_steps: int = 0,
        sft_stages: Sequence[int] | None = None,
        eval_batch_size: int = 16,
        replay_fraction: float = 0.0,
        eval_stages: Sequence[int] | None = None,
        eval_every_length: bool = False,
        predict_split: Split = "test",
        cache_dir: str | None = None,
        tokenizer: Any = None,
    ):
        super().__init__()
        self.corpus = [corpus] if isinstance(corpus, str) else (list(corpus) if corpus else None)
        self.dataset_dir = dataset_dir
        self.curriculum = Curriculum(stages, replay_fraction, curriculum, sft_steps)
        self.stages = self.curriculum.stages
        self.eval_lengths = list(self.stages) if eval_stages is None else check_lengths(eval_stages, "eval_stages")
        self.eval_every_length = eval_every_length
        self.train_pairs = train_pairs
        self.val_pairs = val_pairs
        self.test_pairs = test_pairs
        self.split_fractions = check_fractions(split_fractions)
        self.seed = seed
        self.template = template
        self.batch_size = batch_size
        self.sft_batch_size = batch_size if sft_batch_size is None else sft_batch_size
        self.sft_stages = None if sft_stages is None else check_lengths(sft_stages, "sft_stages")
        self.eval_batch_size = eval_batch_size
        self.predict_split = predict_split
        self.cache_dir = cache_dir
        self._check_args()
        self.tokenizer = tokenizer
        self._pools: dict[tuple[int, str], list[Example]] = {}
        self._train_texts: list[Text] | None = None  # the adaptive schedule draws its GRPO rows from them
        self._usable: dict[int, list[Text]] = {}  # length -> train texts at least that long
        # training batches handed to the training step: counted here, checkpointed here (`batches_run`)
        self._batches_run: int | None = 0
        self.watched_lengths: set[int] = set()  # read at every check by a callback's monitor (the module sets them)
        self._curve_passes = 0  # stages passed when the last whole curve ran: one passed since owes it (checkpointed)
        self._check: tuple[int, list[int]] | None = None  # (batches run, lengths) of the check under way

    def _check_args(self) -> None:
        if self.template not in TEMPLATES:
            raise CorpusError(f"template: unknown {self.template!r}; choose one of: {', '.join(TEMPLATES)}")
        if self.predict_split not in SPLITS:
            raise CorpusError(f"predict_split must be one of {', '.join(SPLITS)}, got {self.predict_split!r}")
        # Each half of the training pairs must be non-empty once the warm-start splits them.
        min_train = 2 if self.sft_steps > 0 else 1
        if self.train_pairs < min_train or self.val_pairs < 0 or self.test_pairs < 0:
            raise CorpusError(f"need train_pairs >= {min_train} and val_pairs, test_pairs >= 0, got {self.pairs}")
        if min(self.batch_size, self.sft_batch_size, self.eval_batch_size) < 1 or self.sft_steps < 0:
            raise CorpusError("batch_size, sft_batch_size and eval_batch_size must be >= 1, sft_steps >= 0")

    def _check_gates(self) -> None:
        """Fit's check: every milestone the adaptive schedule gates on a held-out score is evaluated. Validation, test
        and prediction pass no milestone, so they evaluate whatever lengths they are asked for."""
        gated = [n for n, gate in zip(self.stages, self.curriculum.val_thresholds, strict=True) if gate is not None]
        unseen = [n for n in gated if n not in self.eval_lengths or not self.val_pairs]
        if self.curriculum.adaptive is not None and unseen:
            raise CorpusError(
                f"data.curriculum.val_threshold gates the milestones {unseen}, which are never evaluated: add them to "
                "data.eval_stages with data.val_pairs > 0, or set data.curriculum.val_threshold to null"
            )

    @property
    def pairs(self) -> dict[str, int]:
        """``split -> examples per length``."""
        return {"train": self.train_pairs, "val": self.val_pairs, "test": self.test_pairs}

    def state_dict(self) -> dict:
        state = {"curriculum": self.curriculum.state_dict(), "batches_run": self.batches_run}
        return state | {"curve_passes": self._curve_passes}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.trainer is not None and self.trainer.state.fn != "fit":
            return  # validate, test, predict: the schedule is fit's business, so any schedule evaluates any checkpoint
        # a checkpoint written before the count was kept here resumes at the trainer's global step (`batches_run`)
        self._batches_run = state_dict.get("batches_run")
        self.curriculum.load_state_dict(state_dict["curriculum"])
        # a checkpoint written before the count was kept owes no curve: the stages it passed were seen when passed
        self._curve_passes = state_dict.get("curve_passes", stages_passed(self.curriculum.state.history))
        self._check = None

    def _lengths(self) -> dict[str, list[int]]:
        """``split -> lengths`` this module serves; splits asked for zero pairs are left out."""
        train = self.stages if self.sft_stages is None else sorted(set(self.stages) | set(self.sft_stages))
        lengths = {"train": train, "val": self.eval_lengths, "test": self.eval_lengths}
        return {split: ns for split, ns in lengths.items() if self.pairs[split] > 0}

    def _cache_args(self) -> tuple:
        return self.corpus, self._lengths(), self.pairs, self.split_fractions, self.seed

    @property
    def batches_run(self) -> int:
        """Training batches already run, across epochs and restored on resume: the index of the next one.

        Each training batch carries its index in the stream (``batch_index``), and the count moves as the batch goes
        to its training step (`on_before_batch_transfer`), so it is exact whether the checkpoint was saved at the end
        of a batch, after validation, or at the end of fit. Not ``global_step``: under manual optimization a batch
        may take several optimizer steps, or none when skipped. A checkpoint that predates the count gives none;
        such a run resumes at the trainer's global step, its count when every batch took one step.
        """
        if self._batches_run is None:
            return self.trainer.global_step if self.trainer is not None else 0
        return self._batches_run

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Counts a training batch as it goes to its step (`batches_run`); every batch passes unchanged."""
        if isinstance(batch, dict) and "batch_index" in batch:
            self._batches_run = batch["batch_index"] + 1
        return batch

    @property
    def sft_steps(self) -> int:
        """Batches of supervised warm-start before GRPO: the curriculum's, which decides each batch's phase."""
        return self.curriculum.sft_steps

    def prepare_data(self) -> None:
        """Builds and caches the examples (once per node); a no-op when reading a dataset folder."""
        if self.dataset_dir is None:
            build_cache(cache_path(*self._cache_args(), self.cache_dir), *self._cache_args())

    def setup(self, stage: str | None = None) -> None:
        """Loads the examples of every split; safe to call on every rank and more than once."""
        if stage in (None, "fit"):
            self._check_gates()
        if self._pools:
            return
        if self.curriculum.adaptive is not None:
            if self.dataset_dir is not None:
                raise CorpusError(
                    f"{self.dataset_dir}: data.curriculum.adaptive trains at any length and draws its pairs from the "
                    "corpus's training texts; drop data.dataset_dir and name the corpus with data.corpus"
                )
            texts = load_corpus(self.corpus).texts
            self._train_texts = split_texts(texts, self.split_fractions, self.seed)["train"]
        if self.dataset_dir is not None:
            self._pools = {(n, split): self._read_folder(n, split) for split, ns in self._lengths().items() for n in ns}
            return
        path = cache_path(*self._cache_args(), self.cache_dir)
        build_cache(path, *self._cache_args())  # no-op after prepare_data; builds when setup is called on its own
        self._pools = load_cache(path)

    def _read_folder(self, n_words: int, split: str) -> list[Example]:
        examples = read_split(self.dataset_dir, n_words, split)
        if len(examples) < self.pairs[split]:
            raise CorpusError(
                f"{self.dataset_dir}: {n_words}words/{split}.jsonl has {len(examples)} examples, "
                f"{split}_pairs asks for {self.pairs[split]}"
            )
        return examples[: self.pairs[split]]

    def examples(self, n_words: int, split: str) -> list[Example]:
        """The examples of one length and split (empty if this module does not serve them)."""
        if not self._pools:
            raise RuntimeError("InterleaveDataModule has no examples yet: call prepare_data() and setup() first")
        return self._pools.get((n_words, split), [])

    def _train_pool(self, n_words: int, phase: str) -> list[Example]:
        """The SFT half or the GRPO half of a stage's training pairs (all of them when there is no warm-start)."""
        pool = self.examples(n_words, "train")
        if self.sft_steps == 0:
            return pool
        half = len(pool) // 2
        return pool[:half] if phase == "sft" else pool[half:]

    def sample_train_batch(self, k: int, rank: int = 0) -> tuple[str, list[Example]]:
        """Draws training batch ``k`` of ``rank`` at the current length.

        Returns:
            ``(phase, examples)`` with phase "sft" for a warm-start batch (``Curriculum.warm_start``), else "grpo".
        """
        n_words = self.curriculum.draw_length(k)
        rng = random.Random(f"{self.seed}:train:{k}:{rank}")
        if self.curriculum.warm_start(k):
            if self.sft_stages is None:
                return "sft", _sample(rng, self._train_pool(n_words, "sft"), self.sft_batch_size)
            pools = [self._train_pool(n, "sft") for n in self.sft_stages]
            return "sft", [rng.choice(rng.choice(pools)) for _ in range(self.sft_batch_size)]
        n_replay = self.curriculum.replayed(self.batch_size)
        batch = self._draw_grpo(rng, n_words, self.batch_size - n_replay, f"{k}:{rank}")
        replayed = self.curriculum.replay_lengths()
        batch += [self._draw_grpo(rng, rng.choice(replayed), 1, f"{k}:{rank}:{i}")[0] for i in range(n_replay)]
        return "grpo", batch

    def _draw_grpo(self, rng: random.Random, n_words: int, n: int, stream: str) -> list[Example]:
        """``n`` GRPO prompts of ``n_words`` words: from the stage's GRPO half of the training pairs, or under the
        adaptive schedule drawn afresh from the training texts (any length; ids name the batch's ``stream``)."""
        if self._train_texts is None:
            return _sample(rng, self._train_pool(n_words, "grpo"), n)  # one row: the same draw as rng.choice
        if n_words not in self._usable:
            self._usable[n_words] = [t for t in self._train_texts if t.n_words >= n_words]
        usable = self._usable[n_words]
        return [draw_example(rng, usable, n_words, "train", f"drawn-{stream}-{i}") for i in range(n)]

    def sample_refill(self, k: int, round_: int, n: int, n_words: int, rank: int = 0) -> dict:
        """``n`` extra GRPO prompts of ``n_words`` words for refill round ``round_`` of batch ``k`` (dynamic sampling).

        They come from the GRPO half of that stage's training pairs through their own seeded stream, so a resumed
        run draws the same refills, and are collated like a training batch.
        """
        rng = random.Random(f"{self.seed}:refill:{k}:{round_}:{rank}")
        examples = self._draw_grpo(rng, n_words, n, f"refill-{k}:{round_}:{rank}")
        return self.collate(examples, "grpo")

    @property
    def rank(self) -> int:
        """This process's rank among the trainer's (0 without a trainer)."""
        return self.trainer.global_rank if self.trainer is not None else 0

    def collate(self, examples: Sequence[Example], phase: str) -> dict:
        """Formats and tokenizes prompts, left-padded for generation; targets stay strings for the reward.

        Returns:
            ``prompt_ids`` and ``prompt_mask`` (LongTensor [B, P], mask 1 on real tokens), ``prompts``,
            ``targets``, ``a`` and ``b`` (the fragments), ``text_a`` and ``text_b`` (the ids of the texts they were
            cut from: a held-out score's standard error rests on them), ``target_ids`` (each target's token ids, no
            special tokens), ``ids``, ``n_words`` (lists of length B) and ``phase``.
        """
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise RuntimeError(
                "InterleaveDataModule has no tokenizer: pass InterleaveDataModule(tokenizer=model.tokenizer) "
                "(the CLI links model.tokenizer into data.tokenizer)"
            )
        if tokenizer.pad_token_id is None:
            raise RuntimeError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos_token)")
        prompts = [format_prompt(e.a, e.b, self.template, tokenizer) for e in examples]
        special = adds_special_tokens(tokenizer)
        encoded = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=special)
        targets = [e.target for e in examples]
        return {
            "prompt_ids": encoded["input_ids"].long(),  # [B, P]
            "prompt_mask": encoded["attention_mask"].long(),  # [B, P]
            "prompts": prompts,
            "targets": targets,
            "a": [e.a for e in examples],
            "b": [e.b for e in examples],
            "text_a": [e.text_a for e in examples],
            "text_b": [e.text_b for e in examples],
            "target_ids": tokenizer(targets, add_special_tokens=False)["input_ids"],  # B lists of ints
            "ids": [e.id for e in examples],
            "n_words": [e.n_words for e in examples],
            "phase": phase,
        }

    def train_dataloader(self) -> DataLoader:
        # In-process (num_workers=0) so a stage change is seen by the very next batch drawn.
        return _loader(_TrainStream(self), batch_size=None, num_workers=0, collate_fn=self._collate_train)

    def _collate_train(self, item: tuple[int, str, list[Example]]) -> dict:
        """Training batch ``k``, which carries what its step needs of the stream: its index (``batch_index``), where
        the phases lie as it is drawn (``sft_steps``, ``grpo_start``: a check may end the warm start only from a batch
        not drawn yet, so a batch's values are those of its step), and for a GRPO batch ``refill``, ``draw(round, n)``
        of dynamic sampling: ``sample_refill`` for batch ``k`` at its longest length on this rank."""
        k, phase, examples = item
        batch = self.collate(examples, phase) | {"batch_index": k}
        batch |= {"sft_steps": self.curriculum.sft_steps, "grpo_start": self.curriculum.grpo_start}
        if phase == "grpo":  # replayed rows of earlier stages are refilled at the batch's stage, its longest length
            n_words = max(e.n_words for e in examples)
            batch["refill"] = partial(self.sample_refill, k, n_words=n_words, rank=self.rank)
        return batch

    def _eval_loader(self, examples: list[Example]) -> DataLoader:
        return _loader(examples, batch_size=self.eval_batch_size, collate_fn=partial(self.collate, phase="eval"))

    def val_dataloader(self) -> list[DataLoader]:
        return [self._val_loader(n) for n in self.eval_lengths] if self.val_pairs else []

    def _val_loader(self, n_words: int) -> DataLoader:
        """The validation pairs of one length, in `eval_batch_size` batches, served at the checks that run it."""
        examples = self.examples(n_words, "val")
        batches = HeldOutBatches(SequentialSampler(examples), self.eval_batch_size, False, partial(self._runs, n_words))
        return _loader(examples, batch_sampler=batches, collate_fn=partial(self.collate, phase="eval"))

    def _runs(self, n_words: int) -> bool:
        """Whether the validation under way runs `n_words` (`held_out_lengths`)."""
        return n_words in self.held_out_lengths()

    def held_out_lengths(self) -> list[int]:
        """The evaluation lengths the validation under way runs.

        Every one outside fit (validate, test), with `eval_every_length`, at the first check after a stage is passed,
        at the warm start's last check (the curve GRPO's gains are read against), and at the check that ends fit (at
        `max_steps`, or once the run has been told to stop: the curriculum's last stage or a stop); else those whose
        score decides something (`held_out.deciding_lengths`) and those a callback monitors (`watched_lengths`: a
        checkpoint kept by `val/alignment_25w` reads it at every check). Chosen once per check, as its first length is
        asked for, so every length of a check is asked of the same state.
        """
        trainer = self.trainer
        if self.eval_every_length or trainer is None or trainer.state.fn != "fit":
            return self.eval_lengths
        if self._check is None or self._check[0] != self.batches_run:
            passes = stages_passed(self.curriculum.state.history)
            ending = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
            # the warm start's last check (GRPO starts at the next batch): the curve GRPO's gains are read against
            grpo_starts = 0 < self.batches_run == self.curriculum.grpo_start
            whole = ending or grpo_starts or passes > self._curve_passes
            if whole and not trainer.sanity_checking:  # a sanity check runs a batch or two: it shows no curve
                self._curve_passes = passes
            deciding = deciding_lengths(self.curriculum, self.batches_run, self.sft_stages) | self.watched_lengths
            self._check = self.batches_run, checked_lengths(self.eval_lengths, deciding, whole)
        return self._check[1]

    def test_dataloader(self) -> list[DataLoader]:
        return [self._eval_loader(self.examples(n, "test")) for n in self.eval_lengths] if self.test_pairs else []

    def predict_dataloader(self) -> DataLoader:
        lengths = self.lengths_served("predict")
        return self._eval_loader([e for n in lengths for e in self.examples(n, self.predict_split)])

    def lengths_served(self, stage: str) -> list[int]:
        """The lengths a command reads examples of: `fit` its training stages, warm-start lengths and evaluation
        lengths; `validate` and `test` the evaluation lengths; `predict` those of `predict_split`."""
        if stage == "fit":
            return sorted(set(self.stages) | set(self.sft_stages or ()) | set(self.eval_lengths))
        if stage == "predict" and self.predict_split == "train":
            return list(self.stages)
        return list(self.eval_lengths)


class _TrainStream(IterableDataset):
    """Endless training batches; reads the DataModule's stage at every draw."""

    def __init__(self, datamodule: InterleaveDataModule):
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[tuple[int, str, list[Example]]]:
        """``(k, phase, examples)`` from batch ``batches_run`` on: a resumed run continues where it stopped."""
        datamodule = self.datamodule
        k = datamodule.batches_run
        while True:
            yield k, *datamodule.sample_train_batch(k, datamodule.rank)
            k += 1


def _loader(dataset, **kwargs) -> DataLoader:
    """A DataLoader that leaves the global torch RNG alone.

    Every iterator a DataLoader starts draws a seed, from the global RNG unless it has a generator of its own. That
    draw would shift LoRA's dropout masks whenever validation runs or a resumed run restarts its iterator, so a
    resumed run would not continue bitwise; the examples never depend on it.
    """
    return DataLoader(dataset, generator=torch.Generator(), **kwargs)


def _sample(rng: random.Random, pool: list[Example], n: int) -> list[Example]:
    """``n`` distinct examples when the pool allows it, else ``n`` draws with replacement."""
    return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)

"""What the curriculum reads and writes: its settings (`CurriculumSettings`, which check their own values when
built; a per-stage list's count is checked against the stages by `per_stage`), one GRPO batch's counts
(`StepCounts`), the decision it returns (`Decision`, a stop's advice as `StopAdvice` and `SmallerStep`) and the state
it checkpoints (`CurriculumState`). Plain dataclasses; the decisions are `curriculum.Curriculum`'s, and the run that
carries them out words a stop's advice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from interleave_data.corpus import CorpusError
from interleave_data.length_schedule import AdaptiveLength
from interleave_data.pairs import check_length

PER_STAGE = ("threshold", "patience", "min_steps", "val_threshold", "max_stage_steps")  # one value or one per stage
OnCollapse = Literal["raise_temperature", "step_back", "stop"]
DecisionKind = Literal[
    "none", "advance", "milestone", "step_back", "raise_temperature", "done", "stop", "warm_start_end"
]


@dataclass(frozen=True)
class CurriculumSettings:
    """When a stage is learned (or the length moves) and how a collapse is answered.

    Two schedules. With `adaptive` unset, the fixed stages: a stage is learned when, after `min_steps` GRPO batches
    at it, the rolling mean reward of its rows (over `window` batches) has stayed at or above `threshold` for
    `patience` batches, and, if `val_threshold` is set, the last validation score at its length reaches it. Training
    then moves to the next stage.

    With `adaptive` set, the training length follows the sampled success rate after every GRPO batch
    (`interleave_data.length_schedule`, after AdaRFT), and the stages become milestones: the length stays at or under
    the first milestone not yet passed, which passes when the held-out score at its length reaches `val_threshold`
    (or, with `val_threshold` None, when the length reaches it). A passed milestone is exported and announced as a
    stage end is; `threshold`, `patience` and `min_steps` are the fixed stages' and unused here.

    The supervised warm-start (`data.sft_steps` batches) may end earlier: with `warm_start_until` set, GRPO starts
    after the first validation whose score at the first stage reaches it, so the policy starts GRPO where a
    pretrained base model would stand (Llama-3.2-3B started near 0.49 at 10 words), whatever its seed.

    A group is stuck when its G rewards are all equal and below the stage's threshold (a group that is all correct
    is solved, not collapsed). When stuck groups make up `collapse_share` of a batch's groups for `collapse_patience`
    batches in a row, the curriculum responds with `on_collapse`. After `max_collapse_responses` responses at one
    stage length, or when no response is left (at the temperature cap, or at the first stage), it stops training.

    A stage that levels off stops training too: with `plateau_steps` set, when the rolling mean reward has not risen
    more than `plateau_gain` above its best at the stage for that many GRPO batches (only full windows count, so the
    noisy means of a stage's first batches set no best); under the adaptive schedule a longer training length than
    any reached towards the milestone counts as a gain as well, since the rule holds the reward near its target while
    the length climbs. With `max_stage_steps` set, a stage (adaptive: the climb to a milestone) stops training after
    that many GRPO batches. Every stop says why, and what to change; under fixed stages first the settings to add to
    the run's command that resume from the last learned stage with a length halfway to the stopped one inserted.

    Attributes:
        threshold: Rolling mean reward a stage needs; one value for all stages or one per stage.
        patience: Consecutive batches at or above the threshold; one value or one per stage.
        min_steps: GRPO batches at a stage before it may end; one value or one per stage.
        window: Batches in the rolling mean reward.
        val_threshold: Validation score at the stage's length also required to move on (adaptive: to pass the
            milestone); one value or one per stage; None = not required.
        collapse_share: Share of stuck groups that makes a batch count as collapsed, in (0, 1].
        collapse_patience: Consecutive collapsed batches before a response.
        on_collapse: "raise_temperature" (by `temperature_step`, up to `max_temperature`), "step_back" (to the
            previous stage) or "stop" (end training with a message).
        temperature_step: Added to the rollout temperature by each "raise_temperature" response.
        max_temperature: Highest temperature "raise_temperature" goes to.
        max_collapse_responses: Responses at one stage length before the run stops.
        stop_when_done: Stop training when the last stage is learned.
        warm_start_until: End the warm-start at the first validation whose score at the first stage reaches this;
            None = run all of `data.sft_steps`.
        adaptive: The training length as a difficulty that follows the model (`AdaptiveLength`); None = fixed
            stages.
        plateau_steps: GRPO batches at a stage without a gain before training stops; None = no plateau rule.
        plateau_gain: The rise of the rolling mean reward over its best at the stage that counts as a gain, in [0, 1].
        max_stage_steps: GRPO batches a stage may take before training stops; one value or one per stage; None = no
            cap.
    """

    threshold: float | list[float] = 0.9
    patience: int | list[int] = 20
    min_steps: int | list[int] = 50
    window: int = 10
    val_threshold: float | list[float | None] | None = None
    collapse_share: float = 0.8
    collapse_patience: int = 10
    on_collapse: OnCollapse = "raise_temperature"
    temperature_step: float = 0.25
    max_temperature: float = 1.5
    max_collapse_responses: int = 3
    stop_when_done: bool = False
    warm_start_until: float | None = None
    adaptive: AdaptiveLength | None = None
    plateau_steps: int | None = None
    plateau_gain: float = 0.01
    max_stage_steps: int | list[int | None] | None = None

    def __post_init__(self) -> None:
        """Refuse a value out of its range; a list's count against the stages is `per_stage`'s, in `Curriculum`."""
        if any(not 0.0 <= t <= 1.0 for t in _values(self.threshold)):
            raise CorpusError(f"curriculum.threshold must be in [0, 1], got {self.threshold}")
        if min(_values(self.patience), default=1) < 1 or min(_values(self.min_steps), default=0) < 0:
            raise CorpusError(
                f"curriculum: need patience >= 1 and min_steps >= 0, got {self.patience}, {self.min_steps}"
            )
        if self.window < 1 or self.collapse_patience < 1 or self.max_collapse_responses < 1:
            raise CorpusError("curriculum: window, collapse_patience and max_collapse_responses must be >= 1")
        if self.on_collapse not in get_args(OnCollapse):
            raise CorpusError(f"curriculum.on_collapse must be one of {get_args(OnCollapse)}, got {self.on_collapse!r}")
        if not 0.0 < self.collapse_share <= 1.0:
            raise CorpusError(f"curriculum.collapse_share must be in (0, 1], got {self.collapse_share}")
        if self.warm_start_until is not None and not 0.0 < self.warm_start_until <= 1.0:
            raise CorpusError(f"curriculum.warm_start_until must be in (0, 1], got {self.warm_start_until}")
        caps = (self.plateau_steps, *_values(self.max_stage_steps))
        if min((c for c in caps if c is not None), default=1) < 1:
            raise CorpusError(
                f"curriculum: need plateau_steps and max_stage_steps >= 1 or null, got {self.plateau_steps}, "
                f"{self.max_stage_steps}"
            )
        if not 0.0 <= self.plateau_gain <= 1.0:
            raise CorpusError(f"curriculum.plateau_gain must be in [0, 1], got {self.plateau_gain}")


@dataclass(frozen=True)
class StepCounts:
    """One GRPO batch, over its rows at the current stage, summed over ranks.

    Attributes:
        reward: Mean reward of the rows.
        zero_std_share: Share of groups whose G rewards are all equal.
        stuck_share: Share of groups whose G rewards are all equal and below the stage's threshold.
        distinct: Distinct completions per group.
        temperature: The rollout temperature the batch was sampled at.
        batch: Index of the batch in the training stream (for the history).
        next_batch: First batch not drawn yet: a move takes effect there.
        global_step: The trainer's step (for the history).
        success_rate: Share of the rows whose reward reached the success level (`Curriculum.success_level`).
    """

    reward: float
    zero_std_share: float
    stuck_share: float
    distinct: float
    temperature: float
    batch: int
    next_batch: int
    global_step: int
    success_rate: float = 0.0


@dataclass(frozen=True)
class SmallerStep:
    """The first change a stop under fixed stages advises: go on with a length halfway to the stopped stage inserted
    before it (`curriculum.split_stage`).

    Attributes:
        stages: The stages from the stopped one on, the inserted length first.
        per_stage: Each per-stage setting given as a list (`PER_STAGE` order), rewritten for `stages`: the inserted
            length takes the values of the stage it splits. A setting of one value applies to every stage and is not
            here.
        learned_words: The last learned stage, whose weights to resume from; None = rerun (the first stage stopped).
    """

    stages: list[int]
    per_stage: dict[str, list]
    learned_words: int | None

    @property
    def rerun(self) -> bool:
        """No stage was learned: the run starts again rather than resuming from a learned stage's weights."""
        return self.learned_words is None


@dataclass(frozen=True)
class StopAdvice:
    """Why the curriculum stops training and what to change, in the order to try.

    Attributes:
        why: What happened, in words.
        smaller_step: First, a smaller step between lengths; None under the adaptive schedule (its length already
            moves in small steps) or when no whole length lies between.
        others: Then these changes, in words; the last is a supervised warm-start at the length.
    """

    why: str
    smaller_step: SmallerStep | None
    others: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    """What the curriculum decided after a batch.

    Attributes:
        kind: "none", or the transition: "advance", "step_back", "raise_temperature", "done" or "stop".
        rolling: The rolling mean reward it was decided on.
        stage_index: The stage trained from now on.
        temperature: The rollout temperature from now on; None = leave it as it is.
        message: One line for the console and TensorBoard; empty when nothing happened, and for a stop until the run
            has worded its advice (`Curriculum.record_stop`).
        export_words: The length of a stage just learned, to export; None = nothing to export.
        stop: Training should end.
        advice: A stop's why and what to change; None for any other decision.
    """

    kind: DecisionKind
    rolling: float
    stage_index: int
    temperature: float | None = None
    message: str = ""
    export_words: int | None = None
    stop: bool = False
    advice: StopAdvice | None = None


@dataclass
class CurriculumState:
    """Everything the curriculum decides from; checkpointed, so a resumed run decides the same.

    Attributes:
        stage_index: The stage being trained; rows drawn at another stage (in flight at a move) are not counted.
        steps: GRPO batches counted at this stage.
        recent: Mean reward at this stage of the last `window` batches.
        above: Consecutive batches whose rolling mean reward was at or above the stage's threshold.
        collapsed: Consecutive batches whose share of stuck groups reached `collapse_share`.
        val_score: The last validation score at this stage's length (None until one is seen at this stage).
        responses: Collapse responses so far, per stage length.
        done: The last stage passed its threshold.
        stopped: Why the curriculum stopped training, if it did.
        history: One entry per transition (stage moves, temperature raises, the end).
        drawn_index: The stage training batches are drawn at; it follows `stage_index` once pending moves apply.
        moves: Pending moves `[from_batch, stage_index]`, in order.
        warm_end: First batch of GRPO once `warm_start_until` has ended the warm-start early, else None.
        level: The adaptive schedule's continuous length (None under fixed stages); batches are drawn at
            `words_of(level)`, and `stage_index` is the milestone it works towards.
        drawn_words: The length training batches are drawn at under the adaptive schedule (None: the stage's).
        best: The best rolling mean reward at this stage, over full windows (None until the window is full); under
            the adaptive schedule, at `best_words`.
        best_words: The training length `best` was reached at: the stage's, or under the adaptive schedule the
            longest reached towards the milestone; 0 while `best` is None.
        since_best: Full-window batches since the last gain (`plateau_gain` over `best`, or a longer length).
    """

    stage_index: int = 0
    steps: int = 0
    recent: list[float] = field(default_factory=list)
    above: int = 0
    collapsed: int = 0
    val_score: float | None = None
    responses: dict[int, int] = field(default_factory=dict)
    done: bool = False
    stopped: str | None = None
    history: list[dict] = field(default_factory=list)
    drawn_index: int = 0
    moves: list[list[int]] = field(default_factory=list)
    warm_end: int | None = None
    level: float | None = None
    drawn_words: int | None = None
    best: float | None = None
    best_words: int = 0
    since_best: int = 0


def check_lengths(lengths: Sequence[int], name: str) -> list[int]:
    """Validates stage lengths: a non-empty sequence of positive integers, strictly increasing.

    Raises:
        CorpusError: Naming ``name`` and the offending values.
    """
    lengths = list(lengths)
    if not lengths:
        raise CorpusError(f"{name} must name at least one length")
    for n in lengths:
        check_length(n, name)
    if any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
        raise CorpusError(f"{name} must be strictly increasing, got {' '.join(map(str, lengths))}")
    return lengths


def _values(value) -> list:
    """A setting's values: those of a per-stage list, or the one value (None included)."""
    return list(value) if isinstance(value, list | tuple) else [value]


def per_stage(value, name: str, lengths: list[int]) -> list:
    """One value per stage from a single value (None included) or a list of one value per stage."""
    if not isinstance(value, list | tuple):
        return [value] * len(lengths)
    if len(value) != len(lengths):
        raise CorpusError(f"curriculum.{name} has {len(value)} values for {len(lengths)} stages {lengths}")
    return list(value)

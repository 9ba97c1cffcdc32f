"""The curriculum: stage lengths, replay, when a stage is learned, what to do when training collapses, and its state.

Plain Python, no torch and no Lightning, so each decision is tested on its own: `Curriculum.observe` takes one GRPO
batch's counts (`StepCounts`, already summed over ranks) and returns a `Decision` (a stop's advice as data: the run
words it and hands the line back to `record_stop`); the DataModule asks `Curriculum.draw_length(k)` which length
batch k is drawn at, and checkpoints `state_dict()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from interleave_data.corpus import CorpusError
from interleave_data.curriculum_types import (
    PER_STAGE,
    CurriculumSettings,
    CurriculumState,
    Decision,
    DecisionKind,
    SmallerStep,
    StepCounts,
    StopAdvice,
    check_lengths,
    per_stage,
)
from interleave_data.length_schedule import REPLAY_SPREAD, next_level, replay_range, words_of


class Curriculum:
    """Stages of increasing length, the replay of earlier ones, and the decisions that move between them.

    Args:
        stages: Lengths in words per fragment, strictly increasing.
        replay_fraction: Share of each GRPO batch drawn from earlier stages, in [0, 1).
        settings: Thresholds and the collapse policy.
        sft_steps: Batches of supervised warm-start before GRPO (`warm_start_until` may end it earlier).
    """

    def __init__(
        self,
        stages: Sequence[int],
        replay_fraction: float = 0.0,
        settings: CurriculumSettings | None = None,
        sft_steps: int = 0,
    ) -> None:
        self.stages = check_lengths(stages, "stages")
        if not 0.0 <= replay_fraction < 1.0:
            raise CorpusError(f"replay_fraction must be in [0, 1), got {replay_fraction}")
        self.replay_fraction = replay_fraction
        self.settings = s = settings or CurriculumSettings()  # its values checked when it was built
        # one value per stage; a list's count is checked against the stages here, the one check the settings cannot
        # make on their own
        self.thresholds = per_stage(s.threshold, "threshold", self.stages)
        self.patience = per_stage(s.patience, "patience", self.stages)
        self.min_steps = per_stage(s.min_steps, "min_steps", self.stages)
        self.val_thresholds = per_stage(s.val_threshold, "val_threshold", self.stages)
        self.max_stage_steps = per_stage(s.max_stage_steps, "max_stage_steps", self.stages)
        self.adaptive = s.adaptive
        self.sft_steps = sft_steps
        self.state = self._start_state()

    @property
    def stage_words(self) -> int:
        """Words per fragment at the stage being trained."""
        return self.stages[self.state.stage_index]

    @property
    def threshold(self) -> float:
        """The reward the stage being trained needs."""
        return self.thresholds[self.state.stage_index]

    @property
    def length(self) -> int:
        """Words per fragment training is at: the adaptive schedule's length, or the stage's."""
        return self.stage_words if self.state.level is None else words_of(self.state.level)

    @property
    def success_level(self) -> float:
        """The reward from which a sampled answer counts as a success: `adaptive.success`, or the stage's threshold
        (a group all below it and all equal is stuck)."""
        return self.threshold if self.adaptive is None else self.adaptive.success

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def rolling(self) -> float:
        """Mean reward over the window."""
        return sum(self.state.recent) / len(self.state.recent)

    # ---------------------------------------------------------------- the training stream

    @property
    def grpo_start(self) -> int:
        """The first GRPO batch: `sft_steps`, or earlier where a held-out score ended the warm-start (`warm_end`).
        A warm-start batch is one optimizer step, so it is also the step GRPO starts at; GRPO batches carry it."""
        return self.sft_steps if self.state.warm_end is None else min(self.state.warm_end, self.sft_steps)

    def warm_start(self, k: int) -> bool:
        """Whether batch `k` is a supervised warm-start batch."""
        return k < self.grpo_start

    def draw_length(self, k: int) -> int:
        """The length batch `k` is drawn at; applies the pending moves up to `k`.

        A move is `[from_batch, stage_index]`, or `[from_batch, stage_index, words]` under the adaptive schedule."""
        state = self.state
        while state.moves and state.moves[0][0] <= k:
            move = state.moves.pop(0)
            state.drawn_index = move[1]
            state.drawn_words = move[2] if len(move) > 2 else None
        return self.stages[state.drawn_index] if state.drawn_words is None else state.drawn_words

    def replay_lengths(self) -> Sequence[int]:
        """The lengths replayed beside the drawn one: the earlier stages, or under the adaptive schedule the lengths
        just under it (`length_schedule.REPLAY_SPREAD`)."""
        state = self.state
        if state.drawn_words is None:
            return self.stages[: state.drawn_index]
        return replay_range(state.drawn_words, self.stages[0], REPLAY_SPREAD)

    def replayed(self, batch_size: int) -> int:
        """Prompts of a GRPO batch drawn at replayed lengths; at least one stays at the drawn length, whatever the
        rounding."""
        return min(round(self.replay_fraction * batch_size), batch_size - 1) if self.replay_lengths() else 0

    def move(self, index: int, from_batch: int | None = None) -> None:
        """Train stage `index` from now on: counters restart, responses and history stay.

        Args:
            index: The stage to train at.
            from_batch: First training batch drawn at it; None = the next batch drawn. Under a Trainer that is the
                number of batches run plus one: Lightning has already fetched the next batch at the old stage.
        """
        if not 0 <= index < len(self.stages):
            raise ValueError(f"stage index must be in [0, {len(self.stages) - 1}], got {index}")
        state = self.state
        moves = [m for m in state.moves if m[0] < from_batch] + [[from_batch, index]] if from_batch is not None else []
        self.state = CurriculumState(
            stage_index=index,
            responses=state.responses,
            history=state.history,
            drawn_index=index if from_batch is None else state.drawn_index,
            moves=moves,
        )

    # ---------------------------------------------------------------- the decisions

    def observe_validation(self, score: float, next_batch: int | None = None, global_step: int = 0) -> str:
        """The validation score at the current stage's length, taken before batch `next_batch` (the first batch not
        drawn yet); ends the warm-start from that batch when `warm_start_until` is reached. Returns the message of
        what it decided, or an empty string."""
        state, until = self.state, self.settings.warm_start_until
        state.val_score = score
        if until is None or next_batch is None or not self.warm_start(next_batch) or score < until:
            return ""
        state.warm_end = next_batch
        why = f"held-out score {score:.3f} >= warm_start_until {until}"
        n = self.stage_words
        self._note(next_batch - 1, global_step, "warm_start_end", n, n, why)
        return f"curriculum: the warm-start ends at step {global_step} ({why}); GRPO from batch {next_batch}"

    def observe_milestone(self, score: float, batch: int, global_step: int) -> Decision | None:
        """Under the adaptive schedule, the held-out score at the milestone worked towards, taken after batch `batch`;
        passes it when the score reaches its `val_threshold`. None when nothing passed."""
        gate = self.val_thresholds[self.state.stage_index]
        if self.adaptive is None or self.state.done or gate is None or score < gate:
            return None
        return self._pass_milestone(batch, global_step, f"held-out score {score:.3f} >= {gate}")

    def observe(self, counts: StepCounts) -> Decision:
        """Count one GRPO batch that had rows at the current stage and decide what follows."""
        s, state = self.settings, self.state
        state.steps += 1
        state.recent = (state.recent + [counts.reward])[-s.window :]
        state.above = state.above + 1 if self.rolling >= self.threshold else 0
        state.collapsed = state.collapsed + 1 if counts.stuck_share >= s.collapse_share else 0
        self._track_gain()
        if state.collapsed >= s.collapse_patience:
            return self._respond_to_collapse(counts)
        moved = self._adapt(counts) if self.adaptive is not None else self._learned(counts)
        return moved or self._stalled(counts) or Decision("none", self.rolling, state.stage_index)

    def _adapt(self, counts: StepCounts) -> Decision | None:
        """The adaptive length after this batch; the milestone's decision when the length passes it."""
        low, high = self.stages[0], self.stage_words
        rate = counts.success_rate
        return self._set_level(counts, next_level(self.state.level, rate, self.adaptive, low, high))

    def _learned(self, counts: StepCounts) -> Decision | None:
        """Under fixed stages, the move to the next stage (or the end at the last) once this one is learned."""
        s, state, index = self.settings, self.state, self.state.stage_index
        learned = state.steps >= self.min_steps[index] and state.above >= self.patience[index]
        if self.val_thresholds[index] is not None:
            learned = learned and state.val_score is not None and state.val_score >= self.val_thresholds[index]
        if not learned:
            return None
        n = self.stage_words
        if index + 1 == len(self.stages):
            state.done = True
            message = self._note(
                counts.batch, counts.global_step, "done", n, n, f"last stage learned (reward {self.rolling:.3f})"
            )
            return Decision("done", self.rolling, index, message=message, export_words=n, stop=s.stop_when_done)
        why = f"reward {self.rolling:.3f} >= {self.threshold}"
        return self._move(counts, index + 1, "advance", why, export_words=n)

    def _track_gain(self) -> None:
        """Counts the batches since the last gain: the rolling mean reward more than `plateau_gain` above its best at
        the stage, or, under the adaptive schedule, a longer length than any reached towards the milestone (the rule
        holds the reward near its target while the length climbs). Only full windows count."""
        s, state, words, rolling = self.settings, self.state, self.length, self.rolling
        if len(state.recent) < s.window:
            return
        if words > state.best_words or (words == state.best_words and rolling > state.best + s.plateau_gain):
            state.best, state.best_words, state.since_best = rolling, words, 0
        else:
            state.since_best += 1

    def _stalled(self, counts: StepCounts) -> Decision | None:
        """The stop of a stage that has not gained for `plateau_steps` batches or has run its `max_stage_steps`."""
        s, state, n = self.settings, self.state, self.stage_words
        now = f"now {self.rolling:.3f}" + ("" if state.best is None else f", best {state.best:.3f}")
        if s.plateau_steps is not None and state.since_best >= s.plateau_steps:
            what = f"no gain over {s.plateau_gain} in the rolling reward at {state.best_words} words"
            if self.adaptive is not None:
                what += f" and no longer length towards the {n}-word milestone"
            why = f"{what} for {state.since_best} batches, the plateau_steps ({now})"
            return self._stop(counts, why)
        cap = self.max_stage_steps[state.stage_index]
        if cap is None or state.steps < cap:
            return None
        if state.best is not None:
            now += f", last gain {state.since_best} batches ago"
        why = f"{state.steps} batches at {n} words, the stage's max_stage_steps (rolling reward {now})"
        return self._stop(counts, why, "a larger max_stage_steps if the reward was still rising")

    def _respond_to_collapse(self, counts: StepCounts) -> Decision:
        s, state = self.settings, self.state
        n, temperature = self.stage_words, counts.temperature
        state.responses[n] = state.responses.get(n, 0) + 1
        state.collapsed = 0
        what = (
            f"collapse at {n} words: stuck groups (all G rewards equal, below {self.threshold}) made up "
            f">= {s.collapse_share:.0%} of the batch for {s.collapse_patience} batches (reward {self.rolling:.3f})"
        )
        if state.responses[n] > s.max_collapse_responses:
            why = f"{what}, and {s.max_collapse_responses} responses at this length did not help"
            return self._stop(counts, why)
        if s.on_collapse == "stop":
            responses = "raise_temperature or step_back" if temperature < s.max_temperature else "step_back"
            respond = f"a response to a collapse instead of the stop (on_collapse: {responses})"
            return self._stop(counts, f"{what}, and on_collapse is 'stop'", respond)
        if s.on_collapse == "raise_temperature":
            if temperature >= s.max_temperature:
                why = f"{what}, and the temperature is already at max_temperature={s.max_temperature}"
                return self._stop(counts, why)
            raised = min(temperature + s.temperature_step, s.max_temperature)
            why = f"{what}; temperature {temperature} -> {raised}"
            message = self._note(counts.batch, counts.global_step, "raise_temperature", n, n, why)
            return Decision("raise_temperature", self.rolling, state.stage_index, raised, message)
        if self.adaptive is not None:
            shorter = [m for m in self.stages if m < self.length]
            if not shorter:
                return self._stop(counts, f"{what}, and the length is already at the first milestone")
            message = self._note(counts.batch, counts.global_step, "step_back", self.length, shorter[-1], what)
            self._set_level(counts, float(shorter[-1]))
            return Decision("step_back", self.rolling, state.stage_index, message=message)
        if state.stage_index == 0:
            return self._stop(counts, f"{what}, and there is no earlier stage to step back to")
        return self._move(counts, state.stage_index - 1, "step_back", what)

    def _set_level(self, counts: StepCounts, level: float) -> Decision | None:
        """The adaptive length from batch `counts.next_batch` on; passes the milestone (its decision) when the length
        reaches it and no held-out score is asked of it, else None."""
        state, old = self.state, self.length
        state.level = level
        if self.length != old:
            moves = [m for m in state.moves if m[0] < counts.next_batch]
            state.moves = moves + [[counts.next_batch, state.stage_index, self.length]]
        if not state.done and self.val_thresholds[state.stage_index] is None and self.length >= self.stage_words:
            return self._pass_milestone(counts.batch, counts.global_step, "the training length reached it")
        return None

    def _pass_milestone(self, batch: int, global_step: int, why: str) -> Decision:
        """The milestone worked towards is passed: export it, and work towards the next (or end at the last)."""
        state, n = self.state, self.stage_words
        rolling = self.rolling if state.recent else 0.0
        if state.stage_index + 1 == len(self.stages):
            state.done = True
            message = self._note(batch, global_step, "done", n, n, f"last milestone passed ({why})")
            return Decision("done", rolling, state.stage_index, message=message, export_words=n,
                            stop=self.settings.stop_when_done)  # fmt: skip
        state.stage_index += 1
        state.steps, state.best, state.best_words, state.since_best = 0, None, 0, 0  # counted towards each milestone
        message = self._note(batch, global_step, "milestone", n, self.stage_words, f"{n} words passed ({why})")
        return Decision("milestone", rolling, state.stage_index, message=message, export_words=n)

    def _move(
        self, counts: StepCounts, index: int, kind: DecisionKind, why: str, export_words: int | None = None
    ) -> Decision:
        old, new, rolling = self.stage_words, self.stages[index], self.rolling
        message = self._note(counts.batch, counts.global_step, kind, old, new, why, from_batch=counts.next_batch)
        self.move(index, from_batch=counts.next_batch)
        return Decision(kind, rolling, index, message=message, export_words=export_words)

    def _stop(self, counts: StepCounts, why: str, *others: str) -> Decision:
        """Ends training: why, then what to change: a smaller step between lengths (fixed stages: the adaptive
        length already moves in small steps), `others`, or a supervised warm-start at the length. The run words the
        advice and hands the line back (`record_stop`)."""
        smaller = self._smaller_step() if self.adaptive is None else None
        warm_start = f"a supervised warm-start at {self.length} words (data.sft_stages, data.sft_steps)"
        advice = StopAdvice(why, smaller, (*others, warm_start))
        return Decision("stop", self.rolling, self.state.stage_index, stop=True, advice=advice)

    def record_stop(self, message: str, counts: StepCounts) -> str:
        """Records the stop `observe(counts)` decided, in the words the run gave its advice: the state's `stopped`
        and the history's entry. Returns the transition's one line."""
        n = self.stage_words
        self.state.stopped = message
        return self._note(counts.batch, counts.global_step, "stop", n, n, message)

    def _smaller_step(self) -> SmallerStep | None:
        """The stages from the one being trained on with a length halfway to it inserted before it, resumed from the
        last learned stage (at the first stage: rerun); None when no whole length lies between. Each per-stage list
        is rewritten for the new stages, the inserted one taking the values of the stage it splits, so the settings
        fit together as they are."""
        index = self.state.stage_index
        stages = split_stage(self.stages, index)
        if stages is None:
            return None
        lists = {name: getattr(self.settings, name) for name in PER_STAGE}
        lists = {name: [v[index], *v[index:]] for name, v in lists.items() if isinstance(v, list | tuple)}
        return SmallerStep(stages, lists, self.stages[index - 1] if index else None)

    def _note(self, batch: int, global_step: int, kind: str, old: int, new: int, why: str, **extra) -> str:
        """Append a transition after batch `batch` to the history; returns its one-line message."""
        entry = {"kind": kind, "from_words": old, "to_words": new, "batch": batch}
        self.state.history.append(entry | {"global_step": global_step, "why": why} | extra)
        return f"{kind}: {old} -> {new} words at step {global_step} ({why})"

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state_dict: dict) -> None:
        self.state = CurriculumState(**state_dict)
        if self.adaptive is not None and self.state.level is None:
            raise CorpusError(
                "data.curriculum.adaptive: this checkpoint was trained on fixed stages; resume it without "
                "data.curriculum.adaptive, or start the adaptive schedule with --model.base.init_from"
            )

    def _start_state(self) -> CurriculumState:
        """A fresh state: under the adaptive schedule the length starts at the first milestone."""
        if self.adaptive is None:
            return CurriculumState()
        first = self.stages[0]
        return CurriculumState(level=float(first), drawn_words=first)


def split_stage(stages: Sequence[int], index: int) -> list[int] | None:
    """The stages from `index` on, with the length halfway between stage `index` and the one before it (0 before the
    first) inserted before it; None when no whole length lies between."""
    below = stages[index - 1] if index else 0
    between = (below + stages[index]) // 2
    return [between, *stages[index:]] if between > below else None

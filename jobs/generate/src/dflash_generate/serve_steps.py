"""The serving check's step-by-step comparison: each prompt's engine steps against the offline loop's.

An averaged tau gap hides a drafter that is served differently on some layers or positions (it only has to
average out), and names nothing to look at. Here every prompt that the engine decoded exactly as the offline
loop did (the same tokens, so the same verification targets) is replayed step by step: the offline loop's trace
(`evaluation.json`, `results[i].accepted`) against vLLM's per-request trace (`per_request_spec_decode_metrics:
detailed`: `per_step_accepted` and `per_step_drafted`).

Steps are matched by where they draft: the completion position after the tokens committed before them (the
prefill commits the first token, a step accepting n commits n + 1). A step agrees when the other side also drafted
at that position, as many tokens (B - 1), and accepted as many. After a step that disagrees, the two sides draft at
other positions until they meet again; those steps disagree too, on both sides. The share counted is of all steps,
offline and engine together (an engine that accepts less takes more steps, each of them different), and the first
differing offline step names prompt, step and position to look at.

Drafts come without log-probabilities, so a rounding flip of a draft token cannot be told from a wrong drafter
step by step: the policy is a share (`max_step_mismatch_fraction`). Measured on the test drafters: every step alike
in float32 (engine and offline loop), and over the prompts decoded alike with the engine in bfloat16 against a
float32 offline loop; a drafter whose layers' context keys the engine normalises with another layer's k_norm
(context_k_norm.py) differs on 10-25% of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field


class StepDifference(BaseModel):
    """The first offline step the engine did not take alike."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str = Field(description="Record id of the prompt.")
    step: int = Field(description="Index of the offline step (0 = the first verification).")
    position: int = Field(description="Completion position the step drafted at (tokens committed before it).")
    offline_accepted: int = Field(description="Draft tokens the offline loop accepted there.")
    engine_accepted: int | None = Field(description="Draft tokens the engine accepted there; None: no step there.")
    engine_drafted: int | None = Field(description="Draft tokens the engine proposed there; None: no step there.")

    def describe(self) -> str:
        if self.engine_accepted is None:
            engine = "the engine took no step there"
        else:
            engine = f"engine accepted {self.engine_accepted} of {self.engine_drafted} drafted"
        return (f"prompt {self.prompt_id} step {self.step} (at token {self.position}): offline accepted "
                f"{self.offline_accepted}, {engine}")


class StepComparison(BaseModel):
    """Engine and offline loop, step by step, over the prompts both decoded alike."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompts: int = Field(description="Prompts compared: the engine's output equals the offline loop's.")
    offline_steps: int = Field(description="Offline steps over them.")
    engine_steps: int = Field(description="Engine steps over them.")
    differing: int = Field(
        description="Steps of either side the other did not take alike (position, drafts, accepted).")
    prompts_differing: list[str] = Field(description="Ids of the compared prompts with a differing step.")
    first: StepDifference | None = Field(description="The first differing offline step, in prompt order.")
    max_step_mismatch_fraction: float = Field(description="Largest share of differing steps allowed.")

    @property
    def steps(self) -> int:
        return self.offline_steps + self.engine_steps

    @property
    def fraction(self) -> float:
        return self.differing / self.steps if self.steps else 0.0

    def summary(self) -> str:
        return (f"{self.steps - self.differing}/{self.steps} steps (offline {self.offline_steps}, engine "
                f"{self.engine_steps}) of {self.prompts} prompts alike"
                + (f"; first difference: {self.first.describe()}" if self.first else ""))

    def failure(self) -> str | None:
        """Why the steps disagree beyond the allowed share, or None."""
        if not self.differing or self.fraction <= self.max_step_mismatch_fraction:
            return None
        first = self.first.describe() if self.first else f"prompt {self.prompts_differing[0]}: extra engine steps"
        return (f"the engine's drafter steps differ from the offline loop's on {self.differing}/{self.steps} steps "
                f"({self.fraction:.1%} > {self.max_step_mismatch_fraction:.1%}; offline {self.offline_steps}, engine "
                f"{self.engine_steps}) of {len(self.prompts_differing)}/{self.prompts} prompts decoded alike; first: "
                f"{first}")


def draft_positions(accepted: Sequence[int]) -> list[int]:
    """Where each step drafts: after the prefill's token, each step commits its accepted drafts + 1."""
    positions, at = [], 1
    for n in accepted:
        positions.append(at)
        at += n + 1
    return positions


def step_differences(offline: Sequence[int], engine: Sequence[int], engine_drafted: Sequence[int] | None,
                     drafts: int) -> tuple[list[tuple[int, int, int | None, int | None]], int]:
    """For one prompt: [(step, position, engine accepted, engine drafted)] of each offline step the engine did not
    take alike, and how many engine steps the offline loop did not take alike."""
    drafted = list(engine_drafted) if engine_drafted is not None else [drafts] * len(engine)
    theirs = {p: (n, d) for p, n, d in zip(draft_positions(engine), engine, drafted, strict=True)}
    ours = {p: (n, drafts) for p, n in zip(draft_positions(offline), offline, strict=True)}
    differences = []
    for step, (position, mine) in enumerate(ours.items()):
        got = theirs.get(position)
        if got != mine:
            differences.append((step, position, None if got is None else got[0], None if got is None else got[1]))
    return differences, sum(ours.get(p) != step for p, step in theirs.items())


def compare_steps(prompt_ids: Sequence[str], offline: Sequence[Sequence[int]],
                  engine: Sequence[tuple[Sequence[int], Sequence[int] | None] | None], drafts: int,
                  max_step_mismatch_fraction: float) -> StepComparison:
    """Compare per prompt: `offline[i]` accepted per step, `engine[i]` (accepted, drafted) per step or None when
    the prompt is not compared (decoded differently); `drafts` = B - 1, what the offline loop drafts each step."""
    compared = offline_steps = engine_steps = differing = 0
    prompts_differing: list[str] = []
    first: StepDifference | None = None
    for prompt_id, off, eng in zip(prompt_ids, offline, engine, strict=True):
        if eng is None:
            continue
        compared += 1
        offline_steps += len(off)
        engine_steps += len(eng[0])
        differences, engine_only = step_differences(off, eng[0], eng[1], drafts)
        if not differences and not engine_only:
            continue
        differing += len(differences) + engine_only
        prompts_differing.append(prompt_id)
        if first is None and differences:
            step, position, accepted, drafted = differences[0]
            first = StepDifference(prompt_id=prompt_id, step=step, position=position, offline_accepted=off[step],
                                   engine_accepted=accepted, engine_drafted=drafted)
    return StepComparison(prompts=compared, offline_steps=offline_steps, engine_steps=engine_steps,
                          differing=differing, prompts_differing=prompts_differing, first=first,
                          max_step_mismatch_fraction=max_step_mismatch_fraction)

"""Settings that would change a failed gate's verdict, each tried on the rejected records before it is offered.

A hint that is guessed from the reason alone can make things worse: an empty answer reported as missing
thinking once pointed users at `--enable-thinking false`, which then broke every record that did think. So
each candidate setting is applied to a sample of the records rejected for its reason, and to a sample of
the records kept, by the same worker code the stage runs; it is offered only when most of those rejected
become usable and the kept ones stay usable (at most `max_bad_fraction` of them break).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_shared.manifests import CompletionsSection
from dflash_shared.quality import OVER_MAX_LENGTH, REPETITIVE, THINKING_MISSING, TOO_SHORT, TRUNCATED, Hint
from dflash_tokenize import worker
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.masking import NOT_PREFIX

Samples = Mapping[str, Sequence[tuple[str, bytes]]]
Change = Callable[[worker.WorkerSettings], worker.WorkerSettings]
# Lines long enough for any record, to learn the lengths of records rejected as too long.
_UNBOUNDED = 2**31 - 1


@dataclass(frozen=True)
class Candidate:
    reason: str
    field: str
    value: str
    why: str
    change: Change


def _policy(**changes: Any) -> Change:
    def change(settings: worker.WorkerSettings) -> worker.WorkerSettings:
        return dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, **changes))
    return change


def _settings(**changes: Any) -> Change:
    return lambda settings: dataclasses.replace(settings, **changes)


def _usable(settings: worker.WorkerSettings, chat: ChatFormat,
            lines: Sequence[tuple[str, bytes]]) -> worker.BatchResult:
    worker.init_worker(settings, single_threaded=False, chat=chat)
    return worker.process_batch(list(lines))


def _longer(settings: worker.WorkerSettings, chat: ChatFormat, lines: Sequence[tuple[str, bytes]]) -> int:
    """A max_length that holds the sampled records: their longest, rounded up to a multiple of 1024."""
    result = _usable(dataclasses.replace(settings, max_length=_UNBOUNDED), chat, lines)
    offsets = result.sequences.offsets
    longest = int((offsets[1:] - offsets[:-1]).max()) if len(offsets) > 1 else settings.max_length
    return max(settings.max_length + 1, math.ceil(longest / 1024) * 1024)


def candidates(settings: worker.WorkerSettings, chat: ChatFormat, samples: Samples,
               thinking_is_free: bool) -> list[Candidate]:
    """The settings worth trying for each reason present in `samples`, values computed from the records.

    `thinking_is_free`: the thinking mode is not fixed by the completions' manifest (imported data); when the
    generate stage chose it, the tokenize stage must use the same, so it is never suggested.
    """
    thinking = settings.enable_thinking
    out = []
    if thinking_is_free and THINKING_MISSING in samples and thinking:
        out.append(Candidate(THINKING_MISSING, "enable_thinking", "false", "the answers carry no reasoning",
                             _settings(enable_thinking=False)))
    if thinking_is_free and NOT_PREFIX in samples:
        why = ("the answers carry reasoning, which the template drops when thinking is off" if not thinking else
               "the conversations were written without thinking, which the template renders differently")
        out.append(Candidate(NOT_PREFIX, "enable_thinking", str(not thinking).lower(), why,
                             _settings(enable_thinking=not thinking)))
    if TRUNCATED in samples and not settings.policy.allow_truncated:
        out.append(Candidate(TRUNCATED, "allow_truncated", "true", "the answers were cut at a length limit",
                             _policy(allow_truncated=True)))
    if REPETITIVE in samples and settings.policy.reject_repetitive:
        out.append(Candidate(REPETITIVE, "reject_repetitive", "false", "the answers repeat themselves",
                             _policy(reject_repetitive=False)))
    if TOO_SHORT in samples and settings.policy.min_content_tokens > 1:
        out.append(Candidate(TOO_SHORT, "min_content_tokens", "1",
                             f"the answers are shorter than {settings.policy.min_content_tokens} tokens",
                             _policy(min_content_tokens=1)))
    if OVER_MAX_LENGTH in samples:
        longer = _longer(settings, chat, samples[OVER_MAX_LENGTH])
        out.append(Candidate(OVER_MAX_LENGTH, "max_length", str(longer),
                             f"the records are longer than max_length {settings.max_length}",
                             _settings(max_length=longer)))
    return out


def suggest(settings: worker.WorkerSettings, chat: ChatFormat, samples: Samples, section: object,
            max_bad_fraction: float) -> list[Hint]:
    """The candidates that, tried on the sampled records, make most rejected ones usable and break few kept."""
    free = isinstance(section, CompletionsSection) and section.target is None
    kept = samples.get(worker.KEPT, [])
    hints = []
    for candidate in candidates(settings, chat, samples, free):
        changed = candidate.change(settings)
        rejected = samples[candidate.reason]
        rescued = len(_usable(changed, chat, rejected).sequences)
        still = len(_usable(changed, chat, kept).sequences) if kept else 0
        if rescued * 2 <= len(rejected) or (kept and (len(kept) - still) / len(kept) > max_bad_fraction):
            continue
        checked = f"tried on {len(rejected)} rejected record(s): {rescued} become usable"
        if kept:
            checked += f"; {still} of {len(kept)} kept record(s) stay usable"
        hints.append(Hint(candidate.reason, candidate.field, candidate.value, candidate.why, checked))
    worker.init_worker(settings, single_threaded=False, chat=chat)
    return hints

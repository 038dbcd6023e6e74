"""Degenerate-output detection and the bad-input gate, shared by the generate and tokenize stages.

The pipeline this project replaces trained on a 914K-sample set whose responses were 87% empty, and
nobody noticed. Here every completion is classified once, every reason is counted, and a stage whose
bad fraction passes a threshold fails with a report instead of writing garbage for the trainer.
No torch on purpose: the torch-free tokenizer image and the vLLM image both use it (pyarrow, a shared
dependency, lends its LZ4 codec to the repetition check).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa  # type: ignore[import-untyped]

from dflash_shared.jsonl import printable
from dflash_shared.target_family import THINK_MARKERS

THINK_OPEN, THINK_CLOSE = THINK_MARKERS

# Reasons a completion is unusable for training; the order is the order of precedence in classify().
MALFORMED = "malformed_record"
TRUNCATED = "truncated"
THINKING_UNCLOSED = "thinking_unclosed"
THINKING_MISSING = "thinking_missing"
EMPTY_RESPONSE = "empty_response"
TOO_SHORT = "too_short"
REPETITIVE = "repetitive"
OVER_MAX_LENGTH = "over_max_length"


@dataclass(frozen=True)
class QualityPolicy:
    """Thresholds of the gate; the stage configs expose these as fields."""

    min_content_tokens: int = 4
    allow_truncated: bool = False
    # A completion the generate stage stopped at its own budget (the training window, max_new_tokens) is a
    # prefix of the target's answer, which is all a training window reads of it: kept (see `classify`).
    keep_truncated_by_budget: bool = True
    # Text this long whose last `repetition_window_chars` compress below this ratio (zlib level 1) is a
    # loop ("the the the ...", repeated paragraphs). A degenerate generation loops until it stops, so the
    # tail is where the loop is, and a bounded window keeps the cost per record constant. Calibrated on
    # ~1,000 chunks of code, prose and generated answers (none flagged that a level-6 pass over the whole
    # text with a 0.12 limit did not flag) and ~2,000 planted loops (all that pass flagged, but one, plus
    # loops after a long healthy start, which it missed).
    # Off only for targets that loop by design (the demo's tiny random model); real targets keep it on.
    reject_repetitive: bool = True
    repetition_min_chars: int = 400
    repetition_window_chars: int = 4096
    repetition_max_compression: float = 0.14
    # Pre-filter: a window LZ4 leaves above this ratio is not repetitive, and zlib is not run (6x slower).
    # On the calibration texts zlib level 1 never went below 0.53x the LZ4 ratio, and no text under the
    # zlib limit had an LZ4 ratio above 0.21.
    repetition_lz4_min_compression: float = 0.3
    max_bad_fraction: float = 0.05


_LZ4 = pa.Codec("lz4_raw")


def is_repetitive(text: str, policy: QualityPolicy) -> bool:
    if len(text) < policy.repetition_min_chars:
        return False
    raw = text[-policy.repetition_window_chars :].encode("utf-8")
    if len(_LZ4.compress(raw, asbytes=True)) / len(raw) >= policy.repetition_lz4_min_compression:
        return False
    return len(zlib.compress(raw, 1)) / len(raw) < policy.repetition_max_compression


def classify(
    *,
    content: str,
    reasoning: str | None,
    finish_reason: str | None,
    thinking_requested: bool,
    content_tokens: int | None,
    policy: QualityPolicy,
    budget_cut: bool = False,
    completion_tokens: int | None = None,
) -> str | None:
    """Return the reason a completion is unusable, or None when it is fine.

    An unclosed think block is represented by the record keeping its raw text, opening marker included, in
    `content` (that is how the importer and the engine wrapper store it), so it is found there.

    `budget_cut`: the record's token ids are this pipeline's engine's, so a "length" finish is the generate
    stage's own budget, not an unknown source's limit. Such a completion is kept (policy
    `keep_truncated_by_budget`) whatever its think block or answer look like, since it was stopped before
    either could finish; only a loop (a degenerate model runs to its budget) and a cut before
    `min_content_tokens` of `completion_tokens` (a budget too small to be useful) are rejected.
    """
    if finish_reason == "length" and budget_cut and policy.keep_truncated_by_budget:
        return _budget_cut_reason(content, reasoning, completion_tokens, policy)
    if finish_reason == "length" and not policy.allow_truncated:
        return TRUNCATED
    if THINK_OPEN in content and THINK_CLOSE not in content:
        return THINKING_UNCLOSED
    # An empty answer is that whatever the thinking mode: reported as thinking_missing, it would point at a
    # thinking setting that cannot make it usable.
    if not content.strip():
        return EMPTY_RESPONSE
    if thinking_requested and not (reasoning or "").strip():
        return THINKING_MISSING
    if content_tokens is not None and content_tokens < policy.min_content_tokens:
        return TOO_SHORT
    if policy.reject_repetitive and is_repetitive((reasoning or "") + content, policy):
        return REPETITIVE
    return None


def _budget_cut_reason(content: str, reasoning: str | None, completion_tokens: int | None,
                       policy: QualityPolicy) -> str | None:
    """The verdict on a completion stopped at the generation budget (see `classify`)."""
    if completion_tokens is not None and completion_tokens < policy.min_content_tokens:
        return TRUNCATED
    if policy.reject_repetitive and is_repetitive((reasoning or "") + content, policy):
        return REPETITIVE
    return None


@dataclass
class GateCounts:
    """Per-reason counts and a few examples each; merged across shards for the manifest."""

    seen: int = 0
    bad: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    examples_per_reason: int = 5

    def observe(self, item: str, reason: str | None, detail: str = "") -> None:
        self.seen += 1
        if reason is None:
            return
        self.bad[reason] += 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < self.examples_per_reason:
            # Ids and details may quote the data: escaped, so that a log line or the manifest stays readable.
            kept.append(printable(f"{item}: {detail}" if detail else item)[:500])

    def observe_good(self, count: int) -> None:
        self.seen += count

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())

    @property
    def bad_fraction(self) -> float:
        return self.bad_total / self.seen if self.seen else 0.0

    def report(self) -> str:
        lines = [f"{self.bad_total} of {self.seen} records are unusable ({self.bad_fraction:.1%}):"]
        for reason, count in self.bad.most_common():
            lines.append(f"  {reason}: {count} ({count / max(self.seen, 1):.1%})")
            lines.extend(f"    e.g. {example}" for example in self.examples.get(reason, []))
        return "\n".join(lines)


# The setting that changes each verdict, as a person would type it: (field, value, what is wrong in the data).
# Only for stages that cannot try a setting on their rejected records (tokenize does, see dflash_tokenize.hints).
_FIXES: dict[str, tuple[str, str, str]] = {
    THINKING_MISSING: ("enable_thinking", "false", "the answers carry no reasoning"),
    TRUNCATED: ("allow_truncated", "true", "the answers were cut at a length limit"),
    REPETITIVE: ("reject_repetitive", "false", "the answers repeat themselves"),
    TOO_SHORT: ("min_content_tokens", "1", "the answers are shorter than min_content_tokens"),
    OVER_MAX_LENGTH: ("max_length", "<longer>", "the records are longer than max_length"),
}
# Above this share of unusable records, accepting them (a higher max_bad_fraction) is no fix worth offering.
_MOSTLY_BAD = 0.5


@dataclass(frozen=True)
class Hint:
    """A setting that changes the verdict on records of one reason, with how that was established."""

    reason: str
    field: str
    value: str
    why: str  # what is wrong in the data, in plain words
    checked: str = ""  # e.g. "tried on 12 rejected records: 12 become usable", empty when not tried


def setting_text(field: str, value: str, env_prefix: str) -> str:
    """'--max-length 8192 / DFLASH_TOKENIZE_MAX_LENGTH=8192'."""
    flag = "--" + field.replace("_", "-")
    return f"{flag} {value} / {env_prefix}{field.upper()}={value}"


def limit_value(bad: int, seen: int) -> str | None:
    """The smallest max_bad_fraction (two decimals) that lets `bad` of `seen` pass; None when most are bad."""
    if not seen or bad / seen >= _MOSTLY_BAD:
        return None
    return f"{-(-bad * 100 // seen) / 100:.2f}"  # rounded up in integers: 7 of 100 is 0.07, not 0.08


def fix_hints(reasons: Iterable[str], env_prefix: str, fields: Iterable[str], computed: Sequence[Hint] | None = None,
              bad: int | None = None, seen: int | None = None) -> str:
    """Each way to change the verdict, one per line: the `computed` hints (else the fixed table's, for the
    settings the stage has), then accepting more bad records when most records are usable.

    With `bad` and `seen` the limit is the value that passes this input, else a placeholder.
    """
    known = set(fields)
    hints = list(computed) if computed is not None else [
        Hint(reason, *_FIXES[reason]) for reason in reasons if reason in _FIXES and _FIXES[reason][0] in known]
    lines = []
    for hint in hints:
        checked = f" ({hint.checked})" if hint.checked else ""
        lines.append(f"- {hint.reason}: {hint.why}; set {setting_text(hint.field, hint.value, env_prefix)}{checked}")
    if "max_bad_fraction" in known:
        limit = limit_value(bad, seen) if bad is not None and seen is not None else "<fraction>"
        if limit is not None:
            accept = setting_text("max_bad_fraction", limit, env_prefix)
            lines.append(f"- accept this share of unusable records: {accept}")
    if not lines:
        return "No setting makes most of these records usable: the data needs fixing (see the examples above)."
    return "\n".join(["To change the verdict, any one of:", *lines])


def gate_exceeded(counts: GateCounts, max_bad_fraction: float) -> bool:
    return counts.seen > 0 and counts.bad_fraction > max_bad_fraction


@dataclass
class EarlyDegenerateDetector:
    """Stops a generation pod whose first outputs are mostly garbage, before it burns its GPU hours.

    Looks at the first `window` completions only: a healthy model with a wrong template, a max-new-tokens of
    1 or a broken thinking switch shows itself there, while a few bad answers later on are the gate's job.
    """

    window: int = 64
    max_bad_fraction: float = 0.5
    counts: GateCounts = field(default_factory=GateCounts)

    def observe(self, item: str, reason: str | None, detail: str = "") -> None:
        if self.counts.seen < self.window:
            self.counts.observe(item, reason, detail)

    @property
    def decided(self) -> bool:
        return self.counts.seen >= self.window

    def verdict(self) -> str | None:
        """A failure message once the window is full and mostly bad; None otherwise."""
        if self.decided and self.counts.bad_fraction > self.max_bad_fraction:
            return "the first completions are degenerate, stopping early. " + self.counts.report()
        return None

"""How often bfloat16 rounding parts speculative from plain greedy output, and what the policy catches
(`make bench-numerics`).

The measurement behind the defaults of `dflash_shared.lossless` (tie margin, largest share of parted positions).
For each tiny target (dense Qwen3, Qwen3.6 hybrid) and each drafter (trained, untrained), every prompt is decoded by
the target alone (transformers' greedy `generate`, top log-probabilities kept) and by the offline speculative loop
teacher-forced along it (`speculate.speculative_generate(reference=...)`), in float32 and in bfloat16. With the
policy's allowances opened wide, every parting is recorded with both runs' own margins; then printed: positions
compared, partings, the largest margins seen, and the verdict under the shipped defaults. Last, the two
deliberately lossy verifiers (tests/support/lossy_verifiers.py) run on the same prompts: their verdicts show the
policy catches them.

Runs in the train environment (.venv-train); about 5-10 minutes on 2 cores (the targets and drafters are cached
test fixtures, trained on first use).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def decode_all(drafter: Any, target: Any, prompts: list[list[int]], references: list[Any], stops: Any,
               policy: Any, verifier: Any = None) -> Any:
    from dflash_shared.lossless import Comparing
    from dflash_train.evaluate.speculate import speculative_generate

    comparing = Comparing(policy)
    for i, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        result = speculative_generate(drafter, target, prompt, len(reference.tokens) or 1, stops, 8,
                                      reference=reference, policy=policy, prompt_id=f"p{i}", verifier=verifier)
        comparing.add(reference.logprobs, result.partings)
    return comparing.result()


def shipped_verdict(seen: Any, policy: Any, near_ties: int) -> str | None:
    """`seen` (recorded under a wide policy) judged under `policy`: each parting's tie flag from its margins again."""
    from dflash_shared.lossless import judge_margins

    partings = [p.model_copy(update={"tie": judge_margins(p.speculative_margin, p.plain_margin, policy)})
                for p in seen.partings]
    return seen.model_copy(update={"policy": policy, "partings": partings, "near_tie_positions": near_ties}).failure()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per target (held-out, then training ones)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--targets", default="qwen3,qwen3_6", help="comma-separated: qwen3, qwen3_6")
    args = parser.parse_args()

    import torch

    from dflash_shared.lossless import DEFAULT_MAX_NEAR_TIE_SHARE, DEFAULT_TIE_MARGIN, NumericsPolicy, is_near_tie
    from dflash_train.evaluate.speculate import HookedTarget, greedy_with_logprobs
    from tests.evaluate import eval_fixtures as ef
    from tests.support.lossy_verifiers import LossyVerifier, NearTieRule, RandomRule
    from tests.support.tiny_target import build_tiny_qwen3, build_tiny_qwen3_6

    torch.set_num_threads(1)
    builders = {"qwen3": build_tiny_qwen3, "qwen3_6": build_tiny_qwen3_6}
    wide = NumericsPolicy(dtype="bfloat16", tie_margin=1e9, max_near_tie_share=1.0)  # record, never fail
    shipped = NumericsPolicy.at("bfloat16", DEFAULT_TIE_MARGIN, DEFAULT_MAX_NEAR_TIE_SHARE)
    print(f"shipped policy: {shipped.describe()}")
    rows = []
    for arch in args.targets.split(","):
        began = time.monotonic()
        target_dir = Path(builders[arch]())
        texts = [*ef.heldout_texts(), *ef.train_texts()][: args.prompts]
        prompts = ef.chat_prompts(target_dir, texts)
        stops = ef.stop_ids(target_dir)
        checkpoint = ef.trained_checkpoint(target_dir)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            model = ef.load_target(target_dir).to(dtype)
            trained = ef.load_checkpoint_drafter(checkpoint).to(dtype)
            drafters = {"trained": trained, "untrained": ef.untrained_like(trained).to(dtype)}
            hooked = HookedTarget(model, trained.config.target_layer_ids)
            references = [greedy_with_logprobs(model, p, args.max_new_tokens, stops) for p in prompts]
            record = wide if name == "bfloat16" else NumericsPolicy.at(name)
            # The shipped policy's near-tie positions, counted on the plain run as the stages count them.
            near_ties = sum(is_near_tie(step, DEFAULT_TIE_MARGIN) for r in references for step in r.logprobs)
            for label, drafter in drafters.items():
                seen = decode_all(drafter, hooked, prompts, references, stops, record)
                verdict = shipped_verdict(seen, NumericsPolicy.at(name), near_ties if name == "bfloat16" else 0)
                margins = [max(p.speculative_margin or 0, p.plain_margin or 0) for p in seen.partings]
                rows.append((arch, name, label, seen.positions, near_ties, len(seen.partings), seen.identical,
                             seen.prompts, max(margins, default=0.0), "pass" if verdict is None else "FAIL"))
                for p in seen.partings:
                    print(f"  {arch} {name} {label}: {p.describe()}")
            if name == "bfloat16":
                for label, rule in (("lossy at near-ties", NearTieRule(DEFAULT_TIE_MARGIN)),
                                    ("lossy at 1% random", RandomRule(0.01))):
                    got = decode_all(trained, hooked, prompts, references, stops, shipped, LossyVerifier(rule))
                    failure = got.failure()
                    rows.append((arch, name, f"trained, {label} ({rule.wrong_accepts} wrong accepts)",
                                 got.positions, got.near_tie_positions, len(got.partings), got.identical,
                                 got.prompts, float("nan"), "pass" if failure is None else "FAIL"))
            hooked.close()
        print(f"{arch}: {time.monotonic() - began:.0f} s")

    print()
    print(f"{'target':8} {'dtype':9} {'drafter':46} {'positions':>9} {'near-ties':>9} {'partings':>8} "
          f"{'identical':>9} {'max margin':>10}  verdict (shipped policy)")
    for arch, dtype, label, positions, near, partings, identical, prompts, margin, verdict in rows:
        print(f"{arch:8} {dtype:9} {label:46} {positions:9d} {near:9d} {partings:8d} {identical:5d}/{prompts:<3d} "
              f"{margin:10.4f}  {verdict}")
    honest = [r for r in rows if r[1] == "bfloat16" and "lossy" not in r[2]]
    for arch, _, label, positions, near, partings, *_ in honest:
        print(f"bfloat16 {arch} {label}: {partings} partings at {near} near-tie positions of {positions} "
              f"({partings / max(near, 1):.1%} of near-ties, {partings / max(positions, 1):.3%} of positions)")
    print(f"bound: {DEFAULT_MAX_NEAR_TIE_SHARE:.0%} of the plain run's near-tie positions (top two within "
          f"{DEFAULT_TIE_MARGIN} nats), rounded up")


if __name__ == "__main__":
    main()

"""Deliberately lossy verifiers: test doubles that the numerics policy (dflash_shared.lossless) must catch.

A rule says, where exact greedy verification would reject a draft token (it is not the target's argmax),
whether a lossy verifier accepts it anyway:

* `NearTieRule`: when the draft token is within `margin` nats of the argmax: the kind of wrong acceptance that
  hides where the target's top two are close, which is where drafts cluster;
* `RandomRule`: at a random `rate` of such positions, whatever the margin (seeded).

`LossyVerifier(rule)` is a verifier of the offline loop (`speculate.speculative_generate(verifier=...)`);
`patched_vllm_rejection(rule)` makes vLLM's greedy rejection sampler apply the same rule inside a real engine
(the engine core must run in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class Rule(Protocol):
    wrong_accepts: int

    def accepts_wrong(self, token: int, logits: torch.Tensor) -> bool:
        """Accept draft `token` although it is not the argmax of `logits` [V]?"""


class NearTieRule:
    """Accepts a wrong draft token within `margin` nats of the argmax."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.wrong_accepts = 0

    def accepts_wrong(self, token: int, logits: torch.Tensor) -> bool:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if float(logprobs.max() - logprobs[token]) <= self.margin:
            self.wrong_accepts += 1
            return True
        return False


class RandomRule:
    """Accepts a wrong draft token at `rate` of the positions exact greedy verification rejects."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.wrong_accepts = 0

    def accepts_wrong(self, token: int, logits: torch.Tensor) -> bool:
        del token, logits
        if self.rng.random() < self.rate:
            self.wrong_accepts += 1
            return True
        return False


def accepted_count(rule: Rule, draft: torch.Tensor, logits: torch.Tensor) -> int:
    """Draft tokens accepted in order: a token is accepted when it is the argmax of its row of `logits`
    (exact greedy) or the rule accepts it anyway; the first refused token ends the run."""
    best = logits[: int(draft.shape[0])].argmax(dim=-1)
    n = 0
    for k in range(int(draft.shape[0])):
        token = int(draft[k])
        if token != int(best[k]) and not rule.accepts_wrong(token, logits[k]):
            break
        n += 1
    return n


class LossyVerifier:
    """The offline loop's verifier under `rule`: draft [B-1] against verification logits [B, V]."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule

    def __call__(self, draft: torch.Tensor, logits: torch.Tensor) -> int:
        return accepted_count(self.rule, draft, logits)


@contextlib.contextmanager
def patched_vllm_rejection(rule: Rule) -> Iterator[None]:
    """vLLM's `rejection_sample` (v1 rejection sampler) applying `rule` to greedy requests: the accepted drafts,
    then the target's token at the first refused position (or the bonus token after a fully accepted block),
    exactly the output layout of the real greedy kernel."""
    from vllm.v1.sample import rejection_sampler as sampler

    original = sampler.rejection_sample

    def lossy(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
              cu_num_draft_tokens: torch.Tensor, draft_probs: Any, target_logits: torch.Tensor,
              bonus_token_ids: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                       target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        if not sampling_metadata.all_greedy:
            return out
        start = 0
        for request, count in enumerate(num_draft_tokens):
            draft, logits = draft_token_ids[start : start + count], target_logits[start : start + count]
            n = accepted_count(rule, draft, logits) if count else 0
            row = torch.full_like(out[request], sampler.PLACEHOLDER_TOKEN_ID)
            row[:n] = draft[:n]
            row[n] = logits[n].argmax() if n < count else bonus_token_ids.view(-1)[request]
            out[request] = row
            start += count
        return out

    sampler.rejection_sample = lossy
    try:
        yield
    finally:
        sampler.rejection_sample = original


@contextlib.contextmanager
def werkzeug_proxies_hidden() -> Iterator[None]:
    """Modules that hold werkzeug LocalProxy objects (flask's `current_app`, `request`, ...: the in-process moto
    S3 server imports flask) are taken out of `sys.modules` while the block runs; the modules themselves, and
    everything that imported them, work on unchanged.

    Why: an in-process vLLM engine on CPU rebinds its Triton kernels by scanning the globals of every module in
    `sys.modules` with `hasattr(value, "__dict__")`, and a LocalProxy outside an application context raises
    RuntimeError there (hasattr only swallows AttributeError), so the engine fails to start beside flask.
    """
    import sys

    try:
        from werkzeug.local import LocalProxy
    except ImportError:
        yield
        return

    def holds_proxy(module: Any) -> bool:
        namespace = getattr(module, "__dict__", None) or {}
        # type(), not isinstance(): the proxy forwards __class__ to the object it stands for.
        return any(type(value) is LocalProxy for value in list(namespace.values()))

    hidden = {name: module for name, module in list(sys.modules.items()) if holds_proxy(module)}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)

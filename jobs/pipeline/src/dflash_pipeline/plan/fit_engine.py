"""The memory of a vLLM engine on one GPU, from the target's config.json: the generate and serve-check stages'
part of the fit check (`fit`).

Per GPU of a tensor_parallel_size-way engine (tp: the stage's gpus, as the pipeline wires it), vLLM takes
gpu_memory_utilization x the GPU's total memory (its `budget`) and fills it with:

- the weights / tp (the language model as `target_params` counts it; serve-check adds the drafter's);
- a runtime reserve, an estimate of what vLLM's profile run and start leave besides weights and cache: 1 GiB
  (CUDA graphs, NCCL and other non-torch allocations), the activations of one prefill batch of
  max_num_batched_tokens tokens (4 x hidden + 2 x intermediate / tp values per token, in the weights' dtype) and
  the sampler's float32 logits for max_num_seqs sequences over the whole vocabulary;
- the KV cache, everything left. One sequence of max_model_len tokens needs max_model_len x the KV bytes per
  token (K and V of each full-attention layer: 2 x layers x KV heads / tp x head_dim x dtype bytes; KV heads are
  replicated where there are fewer than tp) plus, on a hybrid target, the fixed recurrent state of each
  linear-attention layer (`TargetSizes.recurrent_bytes_per_sequence`).

The rule:
- refused when the budget leaves no room for one max_model_len sequence after weights and reserve (vLLM refuses
  to start then: its KV cache must hold one whole sequence), or when the budget is more than the GPU has free
  (vLLM refuses to start when free memory is below gpu_memory_utilization x total);
- not refused, but warned, when fewer max_model_len sequences fit at once than the stage keeps in flight
  (min(max_num_seqs, max_inflight) for generate): vLLM then runs as many as fit and queues the rest, so a
  throughput figure measured or assumed at the full concurrency is optimistic. Counted at max_model_len each,
  the worst case: shorter sequences share the cache, and more of them run.
max_num_seqs and max_num_batched_tokens unset are vLLM's defaults for the `LLM` class: 1024 and 16,384 on a GPU
of 70 GiB or more that is not an A100, else 256 and 8,192 (vllm/engine/arg_utils.py, `get_batch_defaults`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dflash_pipeline.plan.gpu_models import GpuModel, fitting
from dflash_train.training.memory_plan import GIB, largest_passing
from dflash_train.training.target_params import TargetSizes

RUNTIME_BYTES = 1 * GIB
LARGE_GPU_BYTES = 70 * GIB


def gib(n: float) -> str:
    """Bytes as GiB with one decimal, as the fit lines print them."""
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Engine:
    """One vLLM engine's settings and the GPU it runs on."""

    sizes: TargetSizes
    gpu: GpuModel
    dtype_bytes: int
    tp: int
    max_model_len: int
    utilization: float
    max_num_seqs: int | None  # None: vLLM's default
    extra_params: int = 0  # serve-check: the drafter's weights
    extra_kv_per_token: int = 0  # serve-check: the drafter's KV layers

    @property
    def large(self) -> bool:
        return self.gpu.total >= LARGE_GPU_BYTES and not self.gpu.a100

    @property
    def seqs(self) -> int:
        return self.max_num_seqs or (1024 if self.large else 256)

    @property
    def budget(self) -> int:
        return int(self.utilization * self.gpu.total)

    @property
    def weights(self) -> int:
        return (self.sizes.params + self.extra_params) * self.dtype_bytes // self.tp

    @property
    def reserve(self) -> int:
        s = self.sizes
        batched = 16384 if self.large else 8192
        prefill = batched * (4 * s.hidden_size + 2 * s.intermediate_size // self.tp) * self.dtype_bytes
        return RUNTIME_BYTES + prefill + self.seqs * s.vocab_size * 4

    @property
    def state(self) -> int:
        return self.sizes.recurrent_bytes_per_sequence(self.dtype_bytes, self.tp)

    @property
    def per_sequence(self) -> int:
        kv_per_token = self.sizes.kv_bytes_per_token(self.dtype_bytes, self.tp) + self.extra_kv_per_token
        return self.max_model_len * kv_per_token + self.state

    @property
    def room(self) -> int:
        """Bytes of KV cache: the budget less weights and reserve."""
        return self.budget - self.weights - self.reserve

    @property
    def at_once(self) -> int:
        """max_model_len sequences the cache holds together."""
        return max(0, self.room // self.per_sequence) if self.per_sequence else 0

    @property
    def need(self) -> int:
        """The least that must fit in the budget: weights, reserve and one whole sequence."""
        return self.weights + self.reserve + self.per_sequence

    @property
    def over_free(self) -> bool:
        return self.budget > self.gpu.usable

    @property
    def fits(self) -> bool:
        return self.room >= self.per_sequence and not self.over_free

    def summary(self) -> str:
        state = f" + {gib(self.state)} recurrent state" if self.state else ""
        return (f"tp {self.tp}: weights {gib(self.weights)} + runtime {gib(self.reserve)} + KV "
                f"{gib(self.per_sequence - self.state)}{state} per {self.max_model_len:,}-token sequence; vLLM "
                f"takes {self.utilization:.2f} x {gib(self.gpu.total)}, its KV cache {gib(max(0, self.room))}: "
                f"{self.at_once} sequence(s) of max_model_len at once")

    def refusal(self) -> str:
        if self.over_free:
            return (f"gpu_memory_utilization {self.utilization:.2f} asks for {gib(self.budget)} of {self.gpu.name}, "
                    f"which has {gib(self.gpu.usable)} free: vLLM refuses to start")
        if self.room < 0:
            return (f"the weights and runtime take {gib(self.weights + self.reserve)} per GPU, more than the "
                    f"{gib(self.budget)} vLLM takes: the engine cannot load")
        return (f"the KV cache gets {gib(self.room)} per GPU, less than the {gib(self.per_sequence)} one "
                f"{self.max_model_len:,}-token sequence needs: vLLM refuses to start")


def remedies(engine: Engine, stage: str, heads: int) -> list[str]:
    """Settings of the run file that would make `engine` fit, each checked with the rule: more tensor
    parallelism, a shorter max_model_len, a higher gpu_memory_utilization, fewer max_num_seqs, a bigger GPU.
    `heads`: attention heads, which tp must divide."""
    out = []
    where = f"stages.{stage}"
    for tp in (2, 4, 8):
        if tp > engine.tp and heads % tp == 0 and replace(engine, tp=tp).fits:
            out.append(f"{where}.gpus = {tp} (one engine over {tp} GPUs: tensor_parallel_size follows gpus)")
            break
    if not engine.over_free:
        length = largest_passing(2, engine.max_model_len - 1, lambda n: replace(engine, max_model_len=n).fits)
        if length is not None:
            out.append(f"{where}.config.max_model_len = {length} or less")
    steps = range(int(engine.utilization * 100) + 1, 100)
    util = next((u / 100 for u in steps if replace(engine, utilization=u / 100).fits), None)
    if util is not None:
        out.append(f"{where}.config.gpu_memory_utilization = {util:.2f} or more")
    if not engine.over_free:
        seqs = largest_passing(1, engine.seqs - 1, lambda n: replace(engine, max_num_seqs=n).fits)
        if seqs is not None:
            out.append(f"{where}.config.max_num_seqs = {seqs} or less")
    bigger = [m for m in fitting(0, usable=False) if m.total > engine.gpu.total
              and replace(engine, gpu=m).fits]
    if bigger:
        out.append("a bigger GPU: " + ", ".join(m.name for m in bigger))
    return out

"""Predicted peak memory of one training rank, printed and checked before anything heavy is loaded.

`plan_memory` adds up, in bytes, what one rank holds at the moment memory peaks, from the configs alone
(the target's shapes come from its config.json and safetensors headers, nothing is loaded):

- the frozen target's weights (whole under DDP; under FSDP this rank's shard of the decoder layers plus
  the gathered layers, with the embedding and LM head whole on every rank, as `parallel.placement` wraps it);
- the drafter's fp32 weights, gradients and AdamW moments (`DRAFTER_STATE_BYTES`);
- the target features the drafter reads, the drafter's activations saved for backward for the worst-case
  anchor count N (N x block_size query tokens over max_length context tokens), the attention's own
  buffers (SDPA: a dense float mask [rows, 1, N*B, S+N*B], and on CUDA the score matrix; flex: none),
  and one LM-head chunk of logits;
- a margin for the allocator (fragmentation, cached blocks) and, on CUDA, library workspaces.

The target is a `target_params.TargetSizes`: counted from its config.json (the pipeline), or with the exact counts
of its safetensors headers (`checkpoint_sizes`, the train stage). The activation coefficients are counted from what
autograd keeps for each op of `model.DFlashDrafter` (eager, op by op) and were checked against a census of saved
tensors (`torch.autograd.graph. saved_tensors_hooks`) on CPU in fp32 and under bf16 autocast; compiled layers save
less, so the plan is an upper bound there. `check` compares the peak with the memory this rank may use (CUDA: free
device memory from torch.cuda.mem_get_info; CPU: MemAvailable, the cgroup's room, shared by the node's ranks) and
refuses a configuration that does not fit with a ConfigError (exit 64) naming the settings that would make it fit.
`window_fits` plans one setup across training windows and GPU classes (bench/bench_memory_plan.py --windows).
The pipeline plans the same way before it submits a run (`dflash_pipeline.plan.fit`), where neither torch nor the
weights are at hand: `target_params.target_sizes` counts the target from config.json alone, `run_inputs` maps the
run's settings as `plan_for_run` does, `auto_parallelism` resolves `parallelism = auto` as the stage will.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from dflash_shared.errors import ConfigError
from dflash_train.drafter.config import DrafterConfig
from dflash_train.sections import TrainingRecipe, TrainingRuntime
from dflash_train.training.target_params import TargetSizes, checkpoint_sizes

log = logging.getLogger(__name__)

GIB = 2**30
# Bytes per drafter parameter held all run long: fp32 weight, fp32 gradient, two fp32 AdamW moments.
DRAFTER_STATE_BYTES = 16
# The threshold of `parallelism = auto` (`auto_parallelism`, for the stage and the pipeline's plan alike): DDP when a
# whole replica takes less than this share of the GPU's total memory.
REPLICA_MEMORY_FRACTION = 0.8
# Allocator margin: CUDA's caching allocator and glibc both keep freed blocks that a later, differently
# shaped tensor cannot reuse; 10% of the peak covers what was measured on CPU. CUDA adds workspaces that
# no tensor accounts for (cuBLAS, NCCL buffers, Triton autotuning): a fixed 1 GiB.
MARGIN_FRACTION = 0.10
CUDA_WORKSPACE_BYTES = 1 * GIB
# Default LM-head chunk budget of `loss.linear_cross_entropy` (1 GiB of float32 logits).
DEFAULT_LOGITS_BYTES = 1 << 30
# SDPA mask: the float32 mask (4 B per element) plus the boolean predicate temporaries its build leaves
# behind (measured on CPU: 6 B per element at the peak, per layer type).
MASK_BYTES_PER_ELEMENT = 6
# FSDP2 prefetches the next layer's all-gather while the current one computes: two unsharded layers.
FSDP_GATHERED_LAYERS = 2
Backend = Literal["flex", "sdpa"]


def drafter_parameter_count(cfg: DrafterConfig) -> tuple[int, int]:
    """(all parameters, parameters of one layer) of `model.DFlashDrafter` for `cfg`."""
    h, hq, hkv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = h * hq * 2 + h * hkv * 2 + 3 * h * cfg.intermediate_size + 2 * cfg.head_dim + 2 * h
    return cfg.num_layers * layer + cfg.feature_size * h + 2 * h, layer


def planned_anchor_count(block_size: int, max_anchors_per_row: int, max_length: int) -> int:
    """The largest N a step can use: one anchor per valid position (at most S - 1), at most the per-row cap,
    on the anchor-count ladder of `anchors` (the plan must hold for the widest step of the run)."""
    from dflash_train.training.anchor_ladder import bucket_anchor_count

    cap = max_anchors_per_row
    return bucket_anchor_count(min(max_length - 1, cap), block_size, cap)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the prediction depends on; `plan_for_run` fills it from a run's configs."""

    drafter: DrafterConfig
    target: TargetSizes
    max_length: int
    micro_batch_rows: int
    anchors: int  # N, anchors per row of the widest step
    max_anchors_per_row: int  # the runtime's cap, which bounds N
    target_bytes: int  # bytes per target parameter as loaded (2 bf16, 4 fp32)
    autocast_bf16: bool
    backend: Backend
    device_type: str  # "cuda" or "cpu"
    parallelism: str  # "ddp" or "fsdp"
    world_size: int
    shard_size: int  # ranks one FSDP shard group spans (the world on one node)
    activation_checkpointing: bool
    chunk_tokens: int | None
    feature_noise: bool
    # The target's own output (FrozenTarget.keep_output): every layer kept and its final hidden states, for the
    # label agreement and the target-label objectives; soft labels (target_kl) also hold the target's logits
    # beside the drafter's in each LM-head chunk.
    target_output: bool = False
    soft_labels: bool = False


DRAFTER_PHASE = "drafter forward/backward"
TARGET_PHASE = "target forward"


@dataclass(frozen=True)
class Term:
    """One line of the plan: what it is, its bytes, and the formula that gives them."""

    name: str
    bytes: int
    formula: str
    # When the term is alive: all run long ("resident"), or in one phase of a step only.
    phase: str = DRAFTER_PHASE


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted peak of one rank (`peak`), its terms, and how it compares with what is available."""

    inputs: PlanInputs
    terms: tuple[Term, ...]  # the terms alive together at the peak (the drafter forward/backward)
    phases: dict[str, int]  # peak of each phase of a step, margin excluded
    margin: Term
    available: int | None = None
    available_source: str = ""

    @property
    def peak(self) -> int:
        return max(self.phases.values()) + self.margin.bytes

    @property
    def fits(self) -> bool:
        return self.available is None or self.peak <= self.available

    def with_available(self, available: int, source: str) -> MemoryPlan:
        return replace(self, available=available, available_source=source)

    def table(self) -> str:
        """The plan as printed in the log: one line per term, then the peak and what is available."""
        i = self.inputs
        q_len = i.anchors * i.drafter.block_size
        head = (f"memory plan per rank ({i.device_type}, {i.parallelism}, {i.world_size} rank(s)): max_length "
                f"{i.max_length}, {i.micro_batch_rows} row(s) per micro-batch, N={i.anchors} anchors x block "
                f"{i.drafter.block_size} = {q_len} query tokens, {i.backend} attention, "
                f"{'bf16 autocast' if i.autocast_bf16 else 'fp32'}"
                f"{', activation checkpointing' if i.activation_checkpointing else ''}")
        width = max(len(t.name) for t in (*self.terms, self.margin))
        lines = [head]
        for term in self.terms:
            where = "" if term.phase == DRAFTER_PHASE else f" [{term.phase}]"
            lines.append(f"  {term.name:<{width}} {_gib(term.bytes):>9}  {term.formula}{where}")
        lines.append(f"  {self.margin.name:<{width}} {_gib(self.margin.bytes):>9}  {self.margin.formula}")
        phases = ", ".join(f"{name} {_gib(b)}" for name, b in self.phases.items())
        lines.append(f"  {'predicted peak':<{width}} {_gib(self.peak):>9}  largest phase + margin; phases: {phases}")
        if self.available is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"  {'available':<{width}} {_gib(self.available):>9}  {self.available_source}: {verdict}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_memory(i: PlanInputs) -> MemoryPlan:
    """The plan for `i` (see the module docstring; every formula is commented where it is made)."""
    cfg, tgt = i.drafter, i.target
    rows, seq, block = i.micro_batch_rows, i.max_length, cfg.block_size
    q_tok = rows * i.anchors * block  # block (query) tokens of a micro-batch
    c_tok = rows * seq  # context tokens
    kv_tok = c_tok + q_tok  # drafter keys: the context, then the block tokens
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layers = cfg.num_layers
    params, layer_params = drafter_parameter_count(cfg)
    sharded = i.parallelism == "fsdp" and i.world_size > 1
    shards = max(1, i.shard_size) if sharded else 1

    # Target weights. FrozenTarget keeps decoder layers 0..max(target_layer_ids) and drops the rest, but
    # only after loading: the load itself holds the whole model (on the device under DDP). Under FSDP each
    # rank holds 1/shards of every kept layer plus the gathered (whole) layers of the current forward.
    kept = list(tgt.layer_params if i.target_output else tgt.layer_params[: max(cfg.target_layer_ids) + 1])
    if sharded:
        target_w = (sum(kept) // shards + FSDP_GATHERED_LAYERS * max(kept) + tgt.whole_params) * i.target_bytes
        target_note = (f"{len(kept)} of {len(tgt.layer_params)} layers kept, 1/{shards} of each + "
                       f"{FSDP_GATHERED_LAYERS} gathered; embedding and LM head whole")
    else:
        target_w = (sum(kept) + tgt.whole_params) * i.target_bytes
        target_note = f"{len(kept)} of {len(tgt.layer_params)} layers kept, whole on this rank"
    target_note += f", {i.target_bytes} B/param"
    # `target_model.loading` drops the unused layers before placing the model on a GPU; on CPU the host is the
    # device, and transformers reads the whole checkpoint into it first (unsharded).
    target_load = tgt.params * i.target_bytes if i.device_type == "cpu" and not sharded else target_w

    # Drafter state: fp32 weights, gradients and two AdamW moments, sharded under FSDP (plus the two gathered
    # layers' bf16 weights and fp32 gradients before their reduce-scatter). DDP keeps a second copy of the
    # gradients in its all-reduce buckets (4 B/param).
    if sharded:
        state = params * DRAFTER_STATE_BYTES // shards + FSDP_GATHERED_LAYERS * layer_params * (2 + 4)
        state_note = f"{params / 1e6:.1f}M params x {DRAFTER_STATE_BYTES} B / {shards} + gathered layers"
    else:
        ddp_buckets = 4 * params if i.world_size > 1 else 0
        state = params * DRAFTER_STATE_BYTES + ddp_buckets
        state_note = (f"{params / 1e6:.1f}M params x {DRAFTER_STATE_BYTES} B (fp32 weight, grad, 2 AdamW moments)"
                      + (" + DDP buckets 4 B" if ddp_buckets else ""))

    # Target features [rows, S, n * H_t] in the target dtype, saved by `fc` for its weight gradient. Without
    # autocast a bf16 target's features are cast to the fp32 drafter (a second, fp32 copy is what fc saves).
    feat_elems = c_tok * cfg.feature_size
    feat_bytes = feat_elems * i.target_bytes
    if i.target_output:  # the final norm's output, kept for the target's own next-token predictions
        feat_bytes += rows * seq * tgt.hidden_size * i.target_bytes
    if not i.autocast_bf16 and i.target_bytes != 4:
        feat_bytes += feat_elems * 4

    # Drafter activations saved for backward, per token, from the ops of model.py (a = saved bytes):
    # fp32: per layer and block token 6H (norm inputs/outputs, normed x) + 5Hq (q, its norm, the rotated q,
    #   attention output and its reshaped copy) + 4I (gate, silu, up, product); per key token 4Hkv (k, its
    #   norm, rotated k, v). RoPE's multiplications save only the cos/sin tables.
    # bf16 autocast: each linear saves its own bf16 cast of its input (q/k/v of the normed x: 3 copies, gate/up:
    #   2), RMSNorm saves an fp32 copy and a bf16 result: per block token 22H + 12Hq + 8I bytes, per key token
    #   10Hkv, per context token 4H (the fp32 context cast to bf16 for k_proj and v_proj in every layer).
    if i.autocast_bf16:
        per_q, per_kv, per_ctx = 22 * h + 12 * hq + 8 * inter, 10 * hkv, 4 * h
        shared = c_tok * 10 * h + q_tok * (10 * h + 2 * h) + 2 * params  # context, final norm, embeds, casts
        layer_input = 2 * h  # the bf16 residual stream a checkpointed layer keeps
    else:
        per_q, per_kv, per_ctx = 4 * (6 * h + 5 * hq + 4 * inter), 16 * hkv, 0
        shared = c_tok * 12 * h + q_tok * 12 * h  # context (fc out, norm, result), final norm and its output
        layer_input = 4 * h
    shared += 8 * cfg.head_dim * (q_tok + kv_tok + c_tok)  # RoPE cos/sin tables, fp32
    one_layer = q_tok * per_q + kv_tok * per_kv + c_tok * per_ctx
    if i.activation_checkpointing:
        # Checkpointed layers keep only their input; backward recomputes one layer at a time.
        acts = layers * q_tok * layer_input + one_layer + shared
        acts_note = f"checkpointed: {layers} layer inputs + 1 recomputed layer"
    else:
        acts = layers * one_layer + shared
        acts_note = f"{layers} layers x ({q_tok} block + {kv_tok} key tokens)"
    acts_note += f", {per_q} B/block token/layer"

    # Attention. flex saves q, k, v, out (counted above) and a logsumexp; its BlockMask is a few KB. SDPA
    # takes a dense float mask [rows, 1, Q, S + Q] per layer type; under autocast every layer saves its own
    # bf16 copy. On CPU SDPA runs the flash kernel (no score matrix, measured); on CUDA torch's fused kernels
    # refuse a float mask with grouped-query heads, so the math kernel keeps softmax scores
    # [rows, heads, Q, S + Q] in fp32 per layer, plus one being computed.
    q_row, kv_row = i.anchors * block, seq + i.anchors * block
    grid = rows * q_row * kv_row  # elements of one [rows, 1, Q, S + Q] mask
    mask_types = len(set(cfg.layer_types)) or 1
    if i.backend == "flex":
        # Nothing here grows with max_length: the BlockMask skips every key block outside a query's window, so
        # a sliding layer's work is ~(W + B) keys per query whatever the row's length; only the full layer
        # reads the whole context.
        attn = q_tok * cfg.num_attention_heads * 4 * layers
        attn_note = "flex: no score matrix (logsumexp only)"
    else:
        # SDPA takes one dense mask over all S + Q keys, sliding layers included (their window is -inf entries
        # in it): linear in max_length for a capped anchor count, and the reason CUDA defaults to flex.
        attn = grid * MASK_BYTES_PER_ELEMENT * mask_types + (grid * 2 * layers if i.autocast_bf16 else 0)
        attn_note = f"sdpa: float mask [{rows}, 1, {q_row}, {kv_row}] x {mask_types} layer type(s)"
        if i.device_type == "cuda":
            attn += grid * cfg.num_attention_heads * 4 * (layers + 1)
            attn_note += f" + fp32 scores x {cfg.num_attention_heads} heads x {layers + 1} (math kernel)"
        else:
            attn_note += " (CPU flash kernel: no score matrix)"

    # LM head: the loss takes the weighted slots (at most N x (B - 1) per row), gathers their hidden states
    # h [T, H] and keeps their gradient [T, H] (both fp32) from its forward. A chunk of logits [chunk, V] is in
    # the head's dtype, and the softmax and its gradient work in place in it: 2 B per logit with a bf16 head, 4 B
    # with an fp32 one. The loop frees each chunk's buffer before the next chunk's logits are made, so one chunk is
    # live at a time.
    trained = rows * i.anchors * (block - 1)
    # Soft labels hold two chunks of logits (the drafter's and the target's log-softmax and probabilities), and
    # the loss halves its default chunk to keep the same budget (loss.linear_token_loss). Beside the drafter's
    # logits: the target's log-softmax and probabilities and their product with the logits (fp32), and a bf16
    # head's logits in fp32 for that product.
    chunk = i.chunk_tokens or max(1, DEFAULT_LOGITS_BYTES // (4 * tgt.vocab_size * (2 if i.soft_labels else 1)))
    chunk = min(chunk, trained)
    per_logit = i.target_bytes + (12 + (4 if i.target_bytes != 4 else 0)) * i.soft_labels
    lm = per_logit * chunk * tgt.vocab_size + 2 * trained * h * 4
    lm_note = f"chunks of {chunk} tokens x {tgt.vocab_size} vocab + h, grad_h [{trained}, {h}] fp32"
    if i.soft_labels:
        # The target's final hidden state at each trained slot's label position, gathered for the soft labels.
        lm += trained * tgt.hidden_size * i.target_bytes
        lm_note += f" + the target's logits beside the drafter's + soft rows [{trained}, {tgt.hidden_size}]"

    # The target's own forward (no grad) before the drafter runs: the captured layer outputs and their
    # concatenation (2x the features), the packed-row mask [rows, 1, S, S] of a dense target (float, plus its
    # boolean build temporaries, as for the drafter's mask) and about one layer's hidden states and MLP
    # activations; feature noise adds an fp32 draw of the features' size and its sum.
    target_fwd = 2 * feat_elems * i.target_bytes + rows * seq * seq * (i.target_bytes + 2)
    target_fwd += c_tok * tgt.layer_activations_per_token * i.target_bytes
    if i.feature_noise:
        target_fwd += feat_elems * 4 * 2
    terms = (
        Term("target weights", target_w, target_note, "resident"),
        Term("drafter + AdamW", state, state_note, "resident"),
        Term("target forward", target_fwd, f"no grad, before the drafter: 2x features + [{rows}, 1, {seq}, {seq}]"
             " mask + one layer's states", TARGET_PHASE),
        Term("target features", feat_bytes, f"[{rows}, {seq}, {cfg.feature_size}] x {i.target_bytes} B"
             + (f" + final hidden [{rows}, {seq}, {tgt.hidden_size}]" if i.target_output else "")),
        Term("drafter activations", acts, acts_note),
        Term("attention", attn, attn_note),
        Term("LM-head chunk", lm, lm_note),
    )
    resident = target_w + state
    phases = {
        "target load": target_load + (state if sharded else 0),
        TARGET_PHASE: resident + target_fwd,
        DRAFTER_PHASE: resident + sum(t.bytes for t in terms if t.phase == DRAFTER_PHASE),
        # foreach AdamW (CPU) computes sqrt of the second moments into a new list: 4 B/param; CUDA's fused
        # kernel allocates nothing of that size.
        "optimizer step": resident + (4 * params // shards if i.device_type != "cuda" else 0),
    }
    top = max(phases.values())
    margin_bytes = int(MARGIN_FRACTION * top) + (CUDA_WORKSPACE_BYTES if i.device_type == "cuda" else 0)
    workspaces = " + 1 GiB CUDA workspaces" if i.device_type == "cuda" else ""
    margin = Term("allocator margin", margin_bytes, f"{MARGIN_FRACTION:.0%} of the peak{workspaces}")
    return MemoryPlan(i, terms, phases, margin)


# ------------------------------------------------------------------------------------------ the run's plan


def plan_for_run(runtime: TrainingRuntime, recipe: TrainingRecipe, cfg: DrafterConfig, target: str | TargetSizes,
                 max_length: int, parallelism: str, env: Any, target_bytes: int) -> MemoryPlan:
    """The plan of a train-stage run (env: distributed.DistEnv).

    `target`: the checkpoint directory (its headers are read here), or its sizes as rank 0 read them (the
    ranks of the other nodes hold no weight files).
    """
    from dflash_train.drafter.attention import resolve_backend

    mesh = env.mesh_shape  # (ranks,) on one node; (nodes, ranks per node) under HSDP: shards span a node
    sizes = target if isinstance(target, TargetSizes) else checkpoint_sizes(target)
    return plan_memory(run_inputs(runtime, recipe, cfg, sizes, max_length, parallelism, device_type=env.device.type,
                                  world_size=env.world_size, shard_size=int(mesh[-1]), target_bytes=target_bytes,
                                  backend=resolve_backend(runtime.attention_backend, env.device)))


def run_inputs(runtime: TrainingRuntime, recipe: TrainingRecipe, cfg: DrafterConfig, target: TargetSizes,
               max_length: int, parallelism: str, *, device_type: str, world_size: int, shard_size: int,
               target_bytes: int, backend: Backend) -> PlanInputs:
    """The plan's inputs from a run's sections (the runtime's memory knobs, the recipe's need of the target's
    output): the one mapping the train stage and the pipeline's pre-submit check both use."""
    return PlanInputs(
        drafter=cfg, target=target, max_length=max_length, micro_batch_rows=runtime.micro_batch_rows,
        anchors=planned_anchor_count(cfg.block_size, runtime.max_anchors_per_row, max_length),
        max_anchors_per_row=runtime.max_anchors_per_row, target_bytes=target_bytes,
        autocast_bf16=runtime.precision == "bf16", backend=backend, device_type=device_type,
        parallelism=parallelism, world_size=world_size, shard_size=shard_size,
        activation_checkpointing=runtime.activation_checkpointing, chunk_tokens=runtime.chunk_tokens,
        feature_noise=recipe.feature_noise_std > 0, target_output=recipe.needs_target_output,
        soft_labels=recipe.objective == "target_kl",
    )


def auto_parallelism(requested: str, replica_bytes: int, drafter_params: int, total_memory: int) -> str:
    """The run's parallelism on a CUDA device of `total_memory` bytes: ddp or fsdp as given; `auto`: ddp when a
    replica (the target's weights plus the drafter's training state) takes less than REPLICA_MEMORY_FRACTION of the
    GPU, else fsdp."""
    if requested in ("ddp", "fsdp"):
        return requested
    need = replica_bytes + drafter_params * DRAFTER_STATE_BYTES
    return "ddp" if need < REPLICA_MEMORY_FRACTION * total_memory else "fsdp"


def choose_parallelism(requested: str, replica_bytes: int, drafter_params: int, device: Any) -> str:
    """The train stage's `auto_parallelism` on `device` (a torch.device); off CUDA `auto` is ddp: host memory is not
    what sharding addresses."""
    if requested in ("ddp", "fsdp"):
        return requested
    if device.type != "cuda":
        return "ddp"
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    choice = auto_parallelism(requested, replica_bytes, drafter_params, total)
    log.info("parallelism auto -> %s: a replica needs %.1f GiB of %.1f GiB", choice,
             (replica_bytes + drafter_params * DRAFTER_STATE_BYTES) / GIB, total / GIB)
    return choice


def check_run(runtime: TrainingRuntime, recipe: TrainingRecipe, cfg: DrafterConfig, target: str | TargetSizes,
              max_length: int, parallelism: str, env: Any, target_bytes: int) -> MemoryPlan:
    """The train stage's hook: plan, compare with this rank's memory, log the table, refuse if it does not fit."""
    plan = plan_for_run(runtime, recipe, cfg, target, max_length, parallelism, env, target_bytes)
    plan = plan.with_available(*available_memory(env.device))
    check(plan, env.any)
    return plan


def available_memory(device: Any) -> tuple[int, str]:
    """(bytes this rank may use, where the figure comes from) on `device` (a torch.device)."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(free), f"torch.cuda.mem_get_info: free of {total / GIB:.1f} GiB on {device}"
    avail, source = _host_available()
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()  # the ranks sharing this host
    ranks = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    if ranks > 1:
        return avail // ranks, f"{source} / {ranks} ranks on this host"
    return avail, source


def _host_available() -> tuple[int, str]:
    """MemAvailable from /proc/meminfo, lowered to the cgroup's room (a pod's limit) where that is less."""
    avail, source = None, ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail, source = int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)"
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        source = "available physical pages (sysconf)"
    room = _cgroup_room()
    if room is not None and room < avail:
        return room, "cgroup memory limit minus its usage"
    return avail, source


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Limit minus usage (page cache not counted) of this process's memory cgroup; None when unlimited."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= 1 << 60:
            return None
        stat_file = (root / limit_file).with_name("memory.stat")
        cache = 0
        try:
            for line in stat_file.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    cache = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(raw) - max(0, usage - cache))
    return None


# ------------------------------------------------------------------------------------------ long windows

# What torch.cuda.mem_get_info reports free on an idle GPU of each class: nvidia-smi's 81,559 MiB (H100/A100
# 80 GB) and 143,771 MiB (H200 141 GB), less ~0.6 GiB of CUDA context.
GPU_CLASSES: dict[str, int] = {"80 GB": int(79.0 * GIB), "141 GB": int(139.8 * GIB)}


@dataclass(frozen=True)
class WindowFit:
    """The plan of one training window and setting, and whether it fits each GPU class."""

    max_length: int
    anchors: int
    parallelism: str
    activation_checkpointing: bool
    peak: int
    fits: dict[str, bool]


def window_fits(base: PlanInputs, windows: tuple[int, ...], density_of: int | None = None,
                gpus: dict[str, int] | None = None) -> list[WindowFit]:
    """`base` planned at each training window, under DDP and FSDP (over base.world_size ranks), each without and
    with activation checkpointing, against each GPU class.

    The anchor cap stays the run's (`max_anchors_per_row`), or with `density_of` grows with the window to
    keep the anchors per token of a `density_of`-token row: a fixed cap spreads the same blocks over more
    context as rows grow, so a long window trains fewer blocks per token of the data.
    """
    gpus = GPU_CLASSES if gpus is None else gpus
    out = []
    for length in windows:
        cap = base.max_anchors_per_row
        if density_of is not None:
            cap = max(1, cap * length // density_of)
        for parallelism in ("ddp", "fsdp"):
            for checkpointing in (False, True):
                plan = plan_memory(replace(base, max_anchors_per_row=cap, max_length=length,
                                           anchors=planned_anchor_count(base.drafter.block_size, cap, length),
                                           parallelism=parallelism,
                                           activation_checkpointing=checkpointing))
                out.append(WindowFit(length, plan.inputs.anchors, parallelism, checkpointing, plan.peak,
                                     {name: plan.peak <= room for name, room in gpus.items()}))
    return out


def window_table(fits: list[WindowFit]) -> str:
    """`window_fits` as printed: one line per window and setting, the peak, and a verdict per GPU class."""
    names = list(fits[0].fits) if fits else []
    lines = [f"{'max_length':>10} {'anchors':>7} {'parallelism':<11} {'ckpt':<4} {'peak':>10}  "
             + "  ".join(f"{name:>7}" for name in names)]
    for fit in fits:
        verdicts = "  ".join(f"{'fits' if fit.fits[name] else 'no':>7}" for name in names)
        lines.append(f"{fit.max_length:>10} {fit.anchors:>7} {fit.parallelism:<11} "
                     f"{'on' if fit.activation_checkpointing else 'off':<4} {_gib(fit.peak):>10}  {verdicts}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ refusal


def _fits(plan: MemoryPlan, **change: Any) -> bool:
    assert plan.available is not None
    return plan_memory(replace(plan.inputs, **change)).peak <= plan.available


def largest_passing(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Largest v in [lo, hi] with ok(v), for ok monotonic (true below some point); None if ok(lo) fails. The
    remedies' search, here and for the engines' fit (`dflash_pipeline.plan.fit_engine`)."""
    if lo > hi or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


@dataclass(frozen=True)
class Remedy:
    """One change that makes a plan fit, checked by re-planning with it: `setting` is max_length,
    micro_batch_rows, max_anchors_per_row (each: the largest value that fits), activation_checkpointing (True),
    attention_backend ("flex"), parallelism ("fsdp") or fsdp_ranks (FSDP over that many ranks of one node)."""

    setting: str
    value: Any


def remedy_settings(plan: MemoryPlan) -> list[Remedy]:
    """Settings that would make `plan` fit, each checked by re-planning with it changed."""
    i = plan.inputs
    out = []
    block = i.drafter.block_size

    def at_length(length: int) -> bool:
        anchors = planned_anchor_count(block, i.max_anchors_per_row, length)
        return _fits(plan, max_length=length, anchors=anchors)

    def at_cap(cap: int) -> bool:
        return _fits(plan, max_anchors_per_row=cap, anchors=planned_anchor_count(block, cap, i.max_length))

    # The largest smaller value of each that fits (none where even the least, 32 tokens or 1, does not).
    searches = (("max_length", 32, i.max_length, at_length),
                ("micro_batch_rows", 1, i.micro_batch_rows, lambda r: _fits(plan, micro_batch_rows=r)),
                ("max_anchors_per_row", 1, i.anchors, at_cap))
    for setting, least, now, ok in searches:
        if (value := largest_passing(least, now - 1, ok)) is not None:
            out.append(Remedy(setting, value))
    if not i.activation_checkpointing and _fits(plan, activation_checkpointing=True):
        out.append(Remedy("activation_checkpointing", True))
    if i.backend == "sdpa" and i.device_type == "cuda" and _fits(plan, backend="flex"):
        out.append(Remedy("attention_backend", "flex"))
    if i.parallelism == "ddp" and i.world_size > 1 and _fits(plan, parallelism="fsdp"):
        out.append(Remedy("parallelism", "fsdp"))
    elif i.parallelism == "ddp" and i.world_size == 1 and i.device_type == "cuda":
        shards = 8
        if _fits(plan, parallelism="fsdp", world_size=shards, shard_size=shards):
            out.append(Remedy("fsdp_ranks", shards))
    return out


# Each remedy as the train stage's command line and environment set it (`{}`: the remedy's value).
_STAGE_FLAGS = {
    "max_length": "max_length (--max-length / DFLASH_TRAIN_MAX_LENGTH) <= {}",
    "micro_batch_rows": "micro_batch_rows (--micro-batch-rows) <= {}",
    "max_anchors_per_row": "max_anchors_per_row (--max-anchors-per-row) <= {}",
    "activation_checkpointing": "activation_checkpointing=true (--activation-checkpointing)",
    "attention_backend": "attention_backend=flex (--attention-backend flex)",
    "parallelism": "parallelism=fsdp (--parallelism fsdp)",
    "fsdp_ranks": "parallelism=fsdp over {0} ranks (torchrun --nproc-per-node {0})",
}


def remedies(plan: MemoryPlan, phrasing: Mapping[str, str] = _STAGE_FLAGS) -> list[str]:
    """Settings that would make `plan` fit, each checked by re-planning with it changed, phrased by `phrasing`
    (a template per `Remedy.setting`; default: the train stage's flags)."""
    return [phrasing[remedy.setting].format(remedy.value) for remedy in remedy_settings(plan)]


def refusal_message(plan: MemoryPlan, fixes: list[str] | None = None) -> str:
    """Why `plan` does not fit and what would (`fixes`, phrased for where the setting is made; default: the
    train stage's flags)."""
    assert plan.available is not None
    phase = max(plan.phases, key=lambda name: plan.phases[name])
    alive = [t for t in plan.terms if t.phase in ("resident", phase)]
    biggest = sorted(alive, key=lambda t: t.bytes, reverse=True)[:3]
    fixes = remedies(plan) if fixes is None else fixes
    return (f"predicted peak memory {_gib(plan.peak)} per rank does not fit the {_gib(plan.available)} available "
            f"({plan.available_source}); it peaks in the {phase}, whose largest terms are "
            + ", ".join(f"{t.name} {_gib(t.bytes)}" for t in biggest)
            + ". Change one of: " + ("; ".join(fixes) if fixes else
                                   "max_length, micro_batch_rows, max_anchors_per_row, parallelism (none alone fits)")
            + f"\n{plan.table()}")


def check(plan: MemoryPlan, any_rank: Callable[[bool], bool] | None = None) -> None:
    """Log the plan; raise ConfigError (exit 64) when it does not fit on this rank or, with `any_rank`
    (DistEnv.any), on any rank, so that all ranks stop together instead of waiting on the one that stopped."""
    log.info("%s", plan.table())
    refuse = not plan.fits
    if any_rank is not None:
        refuse = any_rank(refuse)
    if refuse:
        if plan.fits:
            raise ConfigError("another rank predicts that its memory will not fit (see its log); stopping with it")
        raise ConfigError(refusal_message(plan))

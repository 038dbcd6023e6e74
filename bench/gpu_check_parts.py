"""The parts of bench/gpu_check.py: the Qwen3.6-shaped random target, the step, and the two agreement checks.

Each check returns a dict with "ok" plus its figures; gpu_check.py runs each in its own try block.
Everything runs the project's own code (dflash_train: FrozenTarget, DFlashDrafter, dflash_step, the mask
builders); only the target's weights are random.
"""

from __future__ import annotations

import argparse
import resource
import time
import warnings
from dataclasses import dataclass
from typing import Any

import gpu_check_flops as flops
import gpu_check_phases as phases
import torch

from dflash_train.data.batch import PackedBatch, pack_row, stack_rows
from dflash_train.drafter.attention import (
    DrafterMask,
    attend,
    build_drafter_mask,
    compile_drafter_layers,
    compiled_flex_on_cpu,
)
from dflash_train.drafter.config import QWEN3_6_MASK_TOKEN_ID, DrafterConfig, default_target_layer_ids
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRecipe, TrainingRuntime
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.anchors import anchor_count_buckets, sample_anchors
from dflash_train.training.step import dflash_step

# Qwen3.6-27B's text model (hub config): only the layer count is cut (FULL_DEPTH is the real one).
FULL_DEPTH = 64
# Timed steps the train step keeps even past its share of the budget: fewer say little about a step time.
MIN_TIMED_STEPS = 3
QWEN3_6_27B: dict[str, int] = {
    "hidden": 5120, "intermediate": 17408, "heads": 24, "kv_heads": 4, "head_dim": 256,
    "linear_k_heads": 16, "linear_v_heads": 48, "linear_head_dim": 128, "vocab": 248320,
}
# The CPU smoke shape: Qwen3.6's ratios at toy width, the real vocabulary (the chunked LM head is exercised).
TINY: dict[str, int] = {
    "hidden": 128, "intermediate": 256, "heads": 4, "kv_heads": 1, "head_dim": 64,
    "linear_k_heads": 1, "linear_v_heads": 3, "linear_head_dim": 32, "vocab": 248320,
}
# The tiny drafter: the reference layout (4 sliding + 1 full) at toy width, a window the short rows exceed.
TINY_DRAFTER = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 64}
# Anchors per document of the tiny run (the reference's 512 on the real shape).
TINY_ANCHORS = 8
# Token ids of real text stop below the Qwen3.6 control tokens (248,044 BPE ranks).
TEXT_TOKENS = 248_044
# Tolerances of max |a - b| relative to max |reference|: bf16 keeps 8 mantissa bits (0.4% per rounding) and
# two kernels sum in different orders; float32 (the CPU run) agrees far closer.
ATTENTION_RTOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
FEATURES_RTOL = {torch.bfloat16: 5e-2, torch.float32: 1e-4}
# The packed features must also sit well below the leak a lost document boundary causes.
LEAK_MARGIN = 4.0
FALLBACK_WARNING = "unfused implementation"


@dataclass
class Built:
    """The random target, the drafter and its config."""

    target: FrozenTarget
    cfg: DrafterConfig
    drafter: DFlashDrafter
    build_s: float
    # The step's sections: the reference's anchors (or the tiny run's), CE on the data under exponential decay.
    recipe: TrainingRecipe
    runtime: TrainingRuntime
    # What the train step ended with, for the parts after it (the shapes part runs the same setting).
    rows: int | None = None
    layers_compiled: bool = False
    compile_stepped_down: bool = False

    def describe(self) -> dict[str, Any]:
        decoder = self.target.model.get_decoder()
        kernels = self.target.kernels
        return {
            "target_layer_types": self.target.layer_types,
            "target_kept_layers": len(decoder.layers),
            "target_layer_params_m": round(sum(p.numel() for p in decoder.layers.parameters()) / 1e6, 1),
            "target_dtype": str(self.target.dtype), "packing": self.target.packing,
            "linear_kernels": kernels.describe() if kernels else None,
            "drafter_params_m": round(sum(p.numel() for p in self.drafter.parameters()) / 1e6, 1),
            "drafter": self.cfg.model_dump(), "anchors_per_document": self.recipe.num_anchors,
            "max_anchors_per_row": self.runtime.max_anchors_per_row, "build_s": round(self.build_s, 1),
        }


def feature_layer_ids(layers: int) -> list[int]:
    """The reference 5 feature layers spread over the target (its formula), or every capturable one."""
    return default_target_layer_ids(layers, 5) if layers >= 7 else list(range(layers - 1))


def target_text_config(shape: dict[str, int], layers: int) -> Any:
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    rotary_half = int(shape["head_dim"] * 0.25) // 2  # 32 of 128 frequencies rotate: split [11, 11, 10]
    base, extra = divmod(rotary_half, 3)
    return Qwen3_5TextConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=layers, num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], linear_conv_kernel_dim=4, linear_key_head_dim=shape["linear_head_dim"],
        linear_value_head_dim=shape["linear_head_dim"], linear_num_key_heads=shape["linear_k_heads"],
        linear_num_value_heads=shape["linear_v_heads"], full_attention_interval=4, max_position_embeddings=262144,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [base + (a < extra) for a in range(3)]},
    )


def build(shape: dict[str, int], layers: int, device: torch.device, tiny: bool, num_anchors: int | None) -> Built:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    config = target_text_config(shape, layers)
    overrides: dict[str, Any] = dict(TINY_DRAFTER) if tiny else {}
    recipe = TrainingRecipe(num_anchors=num_anchors or (TINY_ANCHORS if tiny else 512),
                            position_weighting="exp_decay", label_agreement=False)
    cfg = DrafterConfig.from_target(config, mask_token_id=QWEN3_6_MASK_TOKEN_ID,
                                    target_layer_ids=feature_layer_ids(layers), **overrides)
    # bf16 target on CUDA, float32 on CPU: what the trainer's target_dtype "auto" picks.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    target = FrozenTarget(model, cfg.target_layer_ids)
    target.check_drafter_config(cfg)
    drafter = DFlashDrafter(cfg).to(device).train()  # float32 master weights, bf16 autocast in the step
    return Built(target, cfg, drafter, time.perf_counter() - t0, recipe, TrainingRuntime())


def random_batches(count: int, rows: int, seq: int, docs_per_row: int, min_doc: int, seed: int) -> list[PackedBatch]:
    """`count` batches of rows filled by `docs_per_row` documents at random boundaries (each >= min_doc).

    The first eighth of each document is an unmasked prompt, the rest the trained completion.
    """
    if docs_per_row * min_doc > seq:
        raise ValueError(f"{docs_per_row} documents of >= {min_doc} tokens do not fit a row of {seq}; lower"
                         " --docs-per-row or raise --seq")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        packed = []
        for _ in range(rows):
            spare = seq - docs_per_row * min_doc
            cuts = sorted(torch.randint(0, spare + 1, (docs_per_row - 1,), generator=gen).tolist())
            lengths = [min_doc + b - a for a, b in zip([0, *cuts], [*cuts, spare], strict=True)]
            docs = [(torch.randint(0, TEXT_TOKENS, (n,), generator=gen).tolist(),
                     [False] * (n // 8) + [True] * (n - n // 8)) for n in lengths]
            packed.append(pack_row(docs, seq))
        out.append(stack_rows(packed))
    return out


def _first_rows(batch: PackedBatch, rows: int) -> PackedBatch:
    return PackedBatch(batch.input_ids[:rows], batch.position_ids[:rows], batch.document_ids[:rows],
                       batch.loss_mask[:rows])


def _compile_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "aot_autograd": int(counters["aot_autograd"]["total"])}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def full_depth_kinds() -> list[str]:
    """Layer kinds the real target runs for the reference features: its 64 layers up to the last feature layer."""
    kinds = list(target_text_config(QWEN3_6_27B, FULL_DEPTH).layer_types)
    return kinds[: max(feature_layer_ids(FULL_DEPTH)) + 1]


def run_train_step(b: Built, args: argparse.Namespace, device: torch.device, peak: float,
                   matmul_ceiling: float, deadline: float = float("inf")) -> dict[str, Any]:
    """Warm-up, then timed steps of dflash_step + backward + AdamW; tokens/s, per-phase times, MFU (measured
    and projected to the full-depth target), memory, compiles. Timed steps stop at `deadline` (perf_counter
    seconds: this part's share of the budget), after at least MIN_TIMED_STEPS."""
    cfg, target, drafter = b.cfg, b.target, b.drafter
    use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    if use_compile:  # as the trainer does with compile: true (static shapes, limit raised first)
        compile_drafter_layers(drafter.layers, len(anchor_count_buckets(cfg.block_size, b.runtime.max_anchors_per_row)))
    # Documents long enough that every one has num_anchors valid anchors: the query length then depends
    # on the anchor rules (per-document count, any per-row cap), not on the random boundaries.
    min_doc = max(args.seq // 8, -(-(b.recipe.num_anchors + 2) * 8 // 7))
    batches = [x.to(device) for x in random_batches(args.batches, args.rows, args.seq, args.docs_per_row, min_doc, 0)]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4, fused=device.type == "cuda")
    seen: list[tuple[Any, int]] = []  # (drafter mask, query length) of every step

    def capture(module: Any, args_: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        del module
        values = [*args_, *kwargs.values()]
        mask = next(v for v in values if isinstance(v, DrafterMask))
        seen.append((mask, int(values[0].shape[1])))  # block_embeds [B, Q, H] comes first

    hook = drafter.register_forward_pre_hook(capture, with_kwargs=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    timer = phases.PhaseTimer(device)

    def step(i: int, timed: bool = False) -> tuple[int, torch.Tensor]:
        batch = batches[i % len(batches)]
        if timed:
            timer.start()
        with autocast:
            out = dflash_step(drafter, target, batch, cfg, b.recipe, b.runtime,
                              torch.Generator(device=device).manual_seed(i), noise=True)
        timer.mark("loss")
        out.loss.backward()
        timer.mark("backward")
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        if timed:
            timer.end()
        # The loss stays on the device: reading it here would synchronise every step.
        return out.tokens, out.loss.detach()

    # A GPU run is a scarce, single shot: when the first step breaks, record why, step down to a plainer
    # setting and measure that (the part still fails, with the first error among its problems).
    recovered: list[str] = []

    def step_down(error: Exception) -> bool:
        nonlocal batches
        why = f"{type(error).__name__}: {str(error)[:300]}"
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if isinstance(error, torch.OutOfMemoryError) and batches[0].shape[0] > 1:
            batches = [_first_rows(x, x.shape[0] // 2) for x in batches]
            recovered.append(f"out of memory ({why}): rows halved to {batches[0].shape[0]}")
        elif target.packing == "varlen":
            target.packing = "per_document"
            recovered.append(f"varlen packing failed ({why}): the target ran per document")
        elif any(getattr(layer, "_compiled_call_impl", None) is not None for layer in drafter.layers):
            for layer in drafter.layers:
                layer._compiled_call_impl = None  # undoes nn.Module.compile(); attend still compiles flex
            b.compile_stepped_down = True
            recovered.append(f"compiled drafter layers failed ({why}): layers eager, flex still compiled")
        else:
            return False
        return True

    before = _compile_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for i in range(args.warmup):
            while True:
                try:
                    step(i)
                    break
                except Exception as e:
                    if i > 0 or not step_down(e):
                        raise
        _sync(device)
        warmup_s = time.perf_counter() - t0
        after_warmup = _compile_counts()
        warmup_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seen.clear()
        trained, loss_values = [], []
        handles = phases.instrument(timer, target, drafter)
        t0, c0 = time.perf_counter(), flops.clock(device)
        try:
            for i in range(args.warmup, args.warmup + args.steps):
                # The budget is shared with the parts after this one: stop when this part's share is spent.
                if len(trained) >= MIN_TIMED_STEPS and time.perf_counter() > deadline:
                    break
                tokens, loss = step(i, timed=True)
                trained.append(tokens)
                loss_values.append(loss)
            _sync(device)
            wall, clocked = time.perf_counter() - t0, flops.clock(device) - c0
        finally:
            phases.remove(handles)
    hook.remove()
    losses = [float(x) for x in loss_values]
    timed_steps = len(trained)
    b.rows, b.layers_compiled = batches[0].shape[0], use_compile and not b.compile_stepped_down
    after = _compile_counts()
    fallbacks = sum(FALLBACK_WARNING in str(w.message) for w in caught)

    terms: dict[str, float] = {}
    full_target: dict[str, float] = {}
    full_kinds = full_depth_kinds()
    for i, (mask, q_len) in enumerate(seen):
        batch = batches[(args.warmup + i) % len(batches)]
        rows, seq = batch.shape
        by_type = {t: flops.allowed_pairs(mask.for_layer(t), rows, q_len, seq + q_len) for t in set(cfg.layer_types)}
        pairs = [by_type[t][0] for t in cfg.layer_types]
        kept = by_type[cfg.layer_types[0]][1]  # kept block tokens: the same under every layer type
        context = int((batch.document_ids >= 0).sum())
        for part in (flops.target_flops(target, batch.input_ids, batch.document_ids),
                     flops.drafter_flops(cfg, context, kept, pairs),
                     flops.lm_head_flops(target.lm_head_weight.shape[0], cfg.hidden_size, trained[i])):
            for k, v in part.items():
                terms[k] = terms.get(k, 0.0) + v / len(seen)
        for k, v in flops.target_flops(target, batch.input_ids, batch.document_ids, full_kinds).items():
            full_target[k] = full_target.get(k, 0.0) + v / len(seen)
    total = sum(terms.values())
    step_s = wall / timed_steps
    # MFU against the peak per the same clock (`flops.clock`): wall time on CUDA, CPU time on a CPU.
    rate = total * timed_steps / clocked
    context_tokens = sum(int((batches[(args.warmup + i) % len(batches)].document_ids >= 0).sum())
                         for i in range(timed_steps))
    timing = timer.summary()
    kept_kinds = target.layer_types[: len(target.model.get_decoder().layers)]
    try:
        projection = phases.project_full_depth(kept_kinds, full_kinds, timing["target_layer_s_per_step"], step_s,
                                               terms, full_target, rate / peak)
    except ValueError as e:  # e.g. --layers 4 keeps no full-attention layer to scale from
        projection = {"not_tested": f"no full-depth projection: {e}"}
    compiles = {"warmup": {k: after_warmup[k] - before[k] for k in before},
                "timed_steps": {k: after[k] - after_warmup[k] for k in before}}
    result: dict[str, Any] = {
        "rows": batches[0].shape[0], "seq": args.seq, "docs_per_row": args.docs_per_row,
        "distinct_batches": len(batches),
        "steps": timed_steps, "steps_requested": args.steps, "steps_cut_by_budget": timed_steps < args.steps,
        "warmup_steps": args.warmup, "compiled_layers": use_compile,
        "warmup_s": round(warmup_s, 1),
        "step_s": round(step_s, 4), "tokens_per_s": round(context_tokens / wall, 1),
        "trained_tokens_per_s": round(sum(trained) / wall, 1),
        "query_lengths": sorted({q for _, q in seen}), "loss_first_last": [losses[0], losses[-1]],
        "flops_per_step_tflop": {k: round(v / 1e12, 4) for k, v in terms.items()},
        "flops_per_step_total_tflop": round(total / 1e12, 4),
        "flop_formulas": flops.FORMULAS, "model_tflops_per_s": round(rate / 1e12, 4),
        "mfu_clock": "wall time" if device.type == "cuda" else "CPU time of this process (the machine may be shared)",
        "mfu": round(rate / peak, 4), "mfu_vs_measured_matmul": round(rate / matmul_ceiling, 4),
        "compiles": compiles, "flex_unfused_fallback_warnings": fallbacks,
        "phases": timing, "phase_tflops_per_s": phases.phase_rates(timing["phase_s_mean"], terms),
        "full_depth": projection,
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        result["peak_memory_warmup_gib"] = round(warmup_peak / 2**30, 2)  # compilation included
        result["device_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    else:
        result["peak_memory_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        result["peak_memory_kind"] = "host RSS (CPU run)"
    try:
        result |= predicted_peak(b, batches[0].shape[0], args.seq, device)
    except Exception as e:  # noqa: BLE001 - the plan is another module's; its failure is reported, not fatal
        result["memory_plan_error"] = f"{type(e).__name__}: {e}"
    problems: list[str] = []
    if device.type == "cuda" and result.get("memory_plan_peak_gib", float("inf")) < result["peak_memory_gib"]:
        problems.append(f"measured peak {result['peak_memory_gib']} GiB above the memory plan's prediction"
                        f" {result['memory_plan_peak_gib']} GiB (dflash_train.training.memory_plan)")
    if not all(torch.isfinite(torch.tensor(losses))):
        problems.append("a loss is not finite")
    if compiles["timed_steps"]["graphs"] or compiles["timed_steps"]["aot_autograd"]:
        problems.append("the step recompiled during the timed steps (shapes not stable; timings include compiling)")
    if fallbacks:
        problems.append("flex attention fell back to its unfused implementation")
    if not 0 < result["mfu"] <= 1:
        problems.append(f"MFU {result['mfu']} outside (0, 1]: the FLOP count or the peak is wrong")
    if "mfu_full_depth" in projection and not 0 < projection["mfu_full_depth"] <= 1:
        problems.append(f"projected full-depth MFU {projection['mfu_full_depth']} outside (0, 1]")
    problems.extend(timing["problems"])
    problems.extend(recovered)
    result["problems"] = problems
    result["recovered_by"] = recovered
    optimizer.state.clear()  # the other checks need the memory of the Adam states back
    drafter.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ok": not problems, **result}


def predicted_peak(b: Built, rows: int, seq: int, device: torch.device) -> dict[str, Any]:
    """What dflash_train.training.memory_plan predicts for this very step (one rank, no sharding), to set beside
    the measured peak: the GPU is where the plan's activation coefficients meet compiled kernels."""
    from dflash_train.drafter.attention import resolve_backend
    from dflash_train.training import memory_plan
    from dflash_train.training.target_params import TargetSizes

    target, cfg = b.target, b.cfg
    decoder = target.model.get_decoder()
    # FrozenTarget dropped the layers after the last feature layer; every layer of a kind has one size.
    size_of = {kind: sum(p.numel() for p in layer.parameters())
               for kind, layer in zip(target.layer_types, decoder.layers, strict=False)}
    in_layers = sum(p.numel() for p in decoder.layers.parameters())
    whole = sum(p.numel() for p in target.model.parameters()) - in_layers
    shape = TargetSizes(architecture=type(target.model).__name__, layer_types=tuple(target.layer_types),
                        layer_params=tuple(size_of[k] for k in target.layer_types), whole_params=whole,
                        hidden_size=cfg.hidden_size, intermediate_size=int(target.config.intermediate_size),
                        vocab_size=target.vocab_rows, num_key_value_heads=0, head_dim=0,
                        dtype_bytes=target.dtype.itemsize)
    plan = memory_plan.plan_memory(memory_plan.PlanInputs(
        drafter=cfg, target=shape, max_length=seq, micro_batch_rows=rows,
        anchors=memory_plan.planned_anchor_count(cfg.block_size, b.runtime.max_anchors_per_row, seq),
        max_anchors_per_row=b.runtime.max_anchors_per_row, target_bytes=target.dtype.itemsize,
        autocast_bf16=True, backend=resolve_backend(b.runtime.attention_backend, device), device_type=device.type,
        parallelism="ddp", world_size=1, shard_size=1, activation_checkpointing=False, chunk_tokens=None,
        feature_noise=b.recipe.feature_noise_std > 0))
    return {"memory_plan_peak_gib": round(plan.peak / 2**30, 2),
            "memory_plan_phases_gib": {k: round(v / 2**30, 2) for k, v in plan.phases.items()}}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def check_flex_vs_sdpa(b: Built, device: torch.device, seq: int | None = None) -> dict[str, Any]:
    """The drafter attention of both backends on the same q/k/v and the same anchors, per layer type.

    Both through `attend`, the drafter's own call, with flex compiled (as in training on CUDA; on a CPU
    too, where only the forward exists: CPU training runs SDPA). On CUDA the backward is compared as well.
    """
    cfg = b.cfg
    seq = seq or (2048 if device.type == "cuda" else 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    anchors = min(b.recipe.num_anchors, 64)
    batch = random_batches(1, 1, seq, 2, seq // 4, seed=1)[0].to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, anchors, cfg.block_size, generator=gen)
    q_len = anchor_pos.shape[1] * cfg.block_size
    kv_len = seq + q_len
    backward = device.type == "cuda"
    rtol = ATTENTION_RTOL[dtype]
    out: dict[str, Any] = {"dtype": str(dtype), "q_len": q_len, "kv_len": kv_len, "backward": backward,
                           "heads": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim],
                           "rtol_of_max_abs": rtol, "layer_types": {}}
    ok = True
    scale = cfg.head_dim**-0.5
    before = _compile_counts()
    for layer_type in sorted(set(cfg.layer_types)):
        masks = {backend: build_drafter_mask(anchor_pos, keep, batch.document_ids, cfg.block_size, [layer_type],
                                             cfg.sliding_window, backend, dtype=dtype).for_layer(layer_type)
                 for backend in ("flex", "sdpa")}
        g = torch.Generator(device=device).manual_seed(2)
        q = torch.randn(1, cfg.num_attention_heads, q_len, cfg.head_dim, generator=g, device=device, dtype=dtype)
        k = torch.randn(1, cfg.num_key_value_heads, kv_len, cfg.head_dim, generator=g, device=device, dtype=dtype)
        v = torch.randn(1, cfg.num_key_value_heads, kv_len, cfg.head_dim, generator=g, device=device, dtype=dtype)
        upstream = torch.randn(q.shape, generator=g, device=device, dtype=dtype)
        results = {}
        for backend, mask in masks.items():
            qi, ki, vi = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
            with compiled_flex_on_cpu():  # no-op on CUDA, where attend always compiles flex
                o = attend(qi, ki, vi, mask, scale)
            grads = torch.autograd.grad((o.float() * upstream.float()).sum(), (qi, ki, vi)) if backward else ()
            results[backend] = (o.detach(), [gr.detach() for gr in grads])
        (fo, fg), (so, sg) = results["flex"], results["sdpa"]
        row: dict[str, Any] = {"forward_max_abs_diff": _max_diff(fo, so), "forward_ref_max_abs": float(so.abs().max())}
        row_ok = row["forward_max_abs_diff"] <= rtol * row["forward_ref_max_abs"]
        for name, a, r in zip(("dq", "dk", "dv")[: len(fg)], fg, sg, strict=True):
            row[f"{name}_max_abs_diff"], row[f"{name}_ref_max_abs"] = _max_diff(a, r), float(r.abs().max())
            row_ok = row_ok and row[f"{name}_max_abs_diff"] <= rtol * row[f"{name}_ref_max_abs"]
        row["ok"] = bool(row_ok)
        ok = ok and row_ok
        out["layer_types"][layer_type] = row
    after = _compile_counts()
    # Graphs compiled here: flex's kernel for this check's shape (none if the step already compiled it).
    out["compiles"] = {k: after[k] - before[k] for k in before}
    if not ok:
        out["problem"] = "outside tolerance: " + ", ".join(t for t, r in out["layer_types"].items() if not r["ok"])
    if not backward:
        out["untested"] = ["backward (dq, dk, dv): flex attention has no CPU backward; the GPU run compares it"]
    return {"ok": ok, **out}


def check_packed_features(b: Built, device: torch.device) -> dict[str, Any]:
    """Two documents packed in one row against each alone, through the packing the target chose.

    The logic of tests/train/test_target.py (packed row == each document alone) at real width and in the
    target's dtype, plus the leak control: the same row read as ONE document, i.e. what a packing that lost
    the boundary would give. The packed difference must be within tolerance and well below that leak.
    """
    target = b.target
    lengths = (700, 1300) if device.type == "cuda" else (90, 150)
    gen = torch.Generator().manual_seed(3)
    docs = [(torch.randint(0, TEXT_TOKENS, (n,), generator=gen).tolist(), [True] * n) for n in lengths]
    batch = stack_rows([pack_row(docs, sum(lengths))]).to(device)
    packed = target.features(batch.input_ids, batch.position_ids, batch.document_ids)[0]
    joined = target.features(batch.input_ids, batch.position_ids, torch.zeros_like(batch.document_ids))[0]
    diffs, leak, scale, start = [], 0.0, 0.0, 0
    for i, (ids, _) in enumerate(docs):
        t = torch.tensor([ids], device=device)
        alone = target.features(t, torch.arange(len(ids), device=device).unsqueeze(0))[0]
        end = start + len(ids)
        diffs.append(_max_diff(packed[start:end], alone))
        scale = max(scale, float(alone.abs().max()))
        if i > 0:
            leak = max(leak, _max_diff(joined[start:end], alone))
        start = end
    rtol = FEATURES_RTOL[target.dtype]
    result = {"packing": target.packing, "dtype": str(target.dtype), "lengths": list(lengths),
              "max_abs_diff_per_document": diffs, "ref_max_abs": scale, "rtol_of_max_abs": rtol,
              "leak_max_abs_diff": leak, "leak_margin": LEAK_MARGIN,
              "linear_kernels": target.kernels.describe() if target.kernels else None}
    worst = max(diffs)
    ok = worst <= rtol * scale and worst * LEAK_MARGIN <= leak
    if not ok:
        result["problem"] = (f"packed vs alone {worst:.3g} against a tolerance of {rtol * scale:.3g} and a leak of"
                             f" {leak:.3g} (needs {LEAK_MARGIN}x margin)")
    fla = importlib_find("fla")
    result["fla_importable"] = fla
    if device.type == "cuda" and fla and target.packing != "varlen":
        result["problem"] = "flash-linear-attention is importable but the target did not choose varlen packing"
        ok = False
    elif target.packing == "per_document":
        # Both sides then run each document alone through the same code: agreement only shows that the row
        # is split and put back together right, not that a packed forward keeps documents apart.
        why = "flash-linear-attention not importable" if not fla else "the target chose per-document packing"
        result["not_tested"] = (f"{why}: the target ran per document, the same computation as the reference, so"
                                " no packed hybrid forward was compared")
    return {"ok": bool(ok), **result}


def importlib_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None

"""Which kernels a hybrid target's linear-attention (Gated DeltaNet) layers run on.

transformers picks each kernel once, when the model's modeling module is imported
(`use_kernel_func_from_hub_with_fallback`): `chunk_gated_delta_rule` from flash-linear-attention when
`fla` imports, `causal_conv1d_fn` from causal-conv1d when `causal_conv1d` imports, else its PyTorch
reference functions. The reference functions accept the sequence boundaries of a packed batch
(`cu_seqlens`, `seq_idx`) and silently drop them, so a packed forward on them lets the recurrent and
convolution states of one document flow into the next. Only with fast kernels for both is a packed
("varlen") forward right; `FrozenTarget` checks `KernelStatus.varlen` before choosing it.

causal-conv1d is a CUDA extension the package index ships as source only (it builds with nvcc). When
flash-linear-attention is present and causal-conv1d is not, `use_fla_conv` routes the module's
`causal_conv1d_fn` through flash-linear-attention's own Triton causal convolution, which takes the same
boundaries (`cu_seqlens`) and the same layout once transposed. The trainer image ships that pairing.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

logger = logging.getLogger("dflash.train")

FLA = "flash-linear-attention"
CAUSAL_CONV1D = "causal-conv1d"
REFERENCE = "reference"
# Module-level names of the two kernels in transformers' Gated DeltaNet modeling modules.
_DELTA_RULE = "torch_chunk_gated_delta_rule"
_CONV = "causal_conv1d_fn"
_PACKAGE_OF = {_DELTA_RULE: FLA, _CONV: CAUSAL_CONV1D}


@dataclass(frozen=True)
class KernelStatus:
    """Kernel behind each Gated DeltaNet function: a package name, or "reference" (PyTorch)."""

    delta_rule: str
    conv: str

    @property
    def varlen(self) -> bool:
        """True when both kernels honour the sequence boundaries of a packed batch."""
        return REFERENCE not in (self.delta_rule, self.conv)

    def describe(self) -> str:
        def one(role: str, used: str, package: str) -> str:
            if used == REFERENCE:
                return f"{role}: PyTorch reference ({package} not active)"
            return f"{role}: {used}" + ("" if used == package else f" (in place of {package})")

        return (f"{one('gated delta rule', self.delta_rule, FLA)}; "
                f"{one('causal conv1d', self.conv, CAUSAL_CONV1D)}")


def _selected(function: Any, name: str) -> str:
    """What transformers' wrapper `function` (module global `name`) calls."""
    if getattr(function, "_dflash_fla_conv", False):
        return FLA
    try:
        nonlocals = inspect.getclosurevars(function).nonlocals
    except TypeError:
        nonlocals = {}
    if "is_new_implementation" in nonlocals:
        return _PACKAGE_OF[name] if nonlocals["is_new_implementation"] else REFERENCE
    # Not transformers' fallback wrapper: replaced by someone who meant to (a kernel mapping, a test).
    return getattr(function, "_dflash_kernel", "replaced")


def kernel_status(modeling: ModuleType) -> KernelStatus | None:
    """The kernels of `modeling` (a transformers modeling module); None when it has no Gated DeltaNet."""
    if not hasattr(modeling, _DELTA_RULE) or not hasattr(modeling, _CONV):
        return None
    return KernelStatus(delta_rule=_selected(getattr(modeling, _DELTA_RULE), _DELTA_RULE),
                        conv=_selected(getattr(modeling, _CONV), _CONV))


def modeling_module(model_type: str) -> ModuleType | None:
    """transformers' modeling module of `model_type` (e.g. "qwen3_5"), None if it has none."""
    base = model_type.removesuffix("_text")
    try:
        return importlib.import_module(f"transformers.models.{base}.modeling_{base}")
    except ImportError:
        return None


def _fla_conv_available() -> bool:
    try:
        importlib.import_module("fla.modules.causal_conv1d")
    except Exception:  # noqa: BLE001 - fla without a usable Triton (CPU-only torch) counts as absent
        return False
    return True


def use_fla_conv(modeling: ModuleType) -> KernelStatus | None:
    """Route `modeling`'s conv through flash-linear-attention's Triton kernel where that is the gap.

    Only when the delta rule already runs on flash-linear-attention and the conv is the reference one;
    otherwise `modeling` is left as transformers set it up. Returns the status after the change.
    """
    status = kernel_status(modeling)
    if status is None or status.delta_rule != FLA or status.conv != REFERENCE or not _fla_conv_available():
        return status
    setattr(modeling, _CONV, _fla_causal_conv1d_fn)
    logger.info("%s: causal conv1d routed through %s's Triton kernel (%s not installed)",
                modeling.__name__, FLA, CAUSAL_CONV1D)
    return kernel_status(modeling)


def _fla_causal_conv1d_fn(hidden_states: Any, weight: Any, bias: Any = None, activation: str | None = None,
                          cu_seq_lens_q: Any = None, **kwargs: Any) -> Any:
    """causal-conv1d's `causal_conv1d_fn` contract ([B, D, T] in and out) on flash-linear-attention.

    The sequence boundaries come as transformers' `cu_seq_lens_q` (the same kwarg the delta rule reads).
    """
    del kwargs  # seq_idx and the attention kwargs: the boundaries are cu_seq_lens_q
    from fla.modules.causal_conv1d import causal_conv1d

    x = hidden_states.transpose(1, 2).contiguous()
    cu_seqlens = None if cu_seq_lens_q is None else cu_seq_lens_q.to(device=x.device, dtype=_long())
    out, _ = causal_conv1d(x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens)
    return out.transpose(1, 2)


_fla_causal_conv1d_fn._dflash_fla_conv = True  # type: ignore[attr-defined]


def _long() -> Any:
    import torch

    return torch.long

"""GPU products as clusters name them, and the memory each gives a process: what the pre-submit fit check
(`fit`) compares a stage's predicted peak with.

Names are the node label's (`nvidia.com/gpu.product`, as GPU feature discovery sets it: "NVIDIA-H200",
"NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB", ...); matching is liberal (case, spaces or underscores for
dashes, an "NVIDIA" or "Tesla" prefix, form-factor words do not matter), but a name the table cannot place is
unknown, never guessed. A MIG slice is unknown too: its memory is its profile's, not the card's.

Two figures per product: `total`, the device memory nvidia-smi reports (what vLLM's gpu_memory_utilization and
the train stage's `parallelism = auto` rule take fractions of), and `usable`, what torch.cuda.mem_get_info
reports free on an idle GPU, the total less about 0.6 GiB of CUDA context (as `memory_plan.GPU_CLASSES`
reasons; its two figures are used as they are for the 80 GB and 141 GB cards). `[plan] gpu_memory_gib` replaces
the table's total for a GPU the table lacks or a driver that reports otherwise.

Two more, from the vendors' data sheets, scale the plan's default throughputs, which are H200 figures, to the GPU
a stage runs on (`throughput_scale`): memory bandwidth for decoding (generate, evaluate: each token reads the
weights and the KV cache) and dense bf16 tensor throughput for training (large matrix products). A default scaled
so is an estimate, and the plan says so; a rate measured by a pilot or set in the run file is used as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_train.training.memory_plan import GIB, GPU_CLASSES

MIB = 2**20
# CUDA context and driver reservations of a process on an idle GPU: the gap between nvidia-smi's total and
# mem_get_info's free that memory_plan.GPU_CLASSES takes off.
CUDA_CONTEXT_BYTES = int(0.6 * GIB)


@dataclass(frozen=True)
class GpuModel:
    """One GPU product: its label, its total memory, and what a process finds free on it."""

    name: str
    total: int  # bytes, as nvidia-smi reports
    usable: int  # bytes torch.cuda.mem_get_info reports free on an idle GPU
    memory_tb_s: float | None = None  # the data sheet's memory bandwidth (None: a GPU known by its memory only)
    bf16_tflops: float | None = None  # the data sheet's dense bf16 tensor throughput

    @property
    def a100(self) -> bool:
        # vLLM picks smaller batch defaults on A100s whatever their memory (see fit's generation check).
        return "A100" in self.name.upper()


def _model(name: str, total_mib: int, speeds: tuple[float, float], gpu_class: str | None = None) -> GpuModel:
    total = total_mib * MIB
    return GpuModel(name, total, GPU_CLASSES[gpu_class] if gpu_class else total - CUDA_CONTEXT_BYTES, *speeds)


# First match wins: the patterns run over the normalised name (upper case, dashes, no vendor prefix). Each product:
# its label, nvidia-smi's total in MiB, (memory bandwidth TB/s, dense bf16 TFLOPS), and its GPU_CLASSES entry.
# H200 covers the NVL; the H100 and A100 lines their PCIe forms too (the H100 PCIe is slower than listed).
TABLE: tuple[tuple[str, GpuModel], ...] = (
    (r"\bB200\b", _model("NVIDIA-B200", 183_359, (8.0, 2250))),
    (r"\bH200\b", _model("NVIDIA-H200", 143_771, (4.8, 989), "141 GB")),
    (r"\bH100-NVL\b|\bH100-94GB\b", _model("NVIDIA-H100-NVL", 95_830, (3.9, 835))),
    (r"\bH100\b", _model("NVIDIA-H100-80GB-HBM3", 81_559, (3.35, 989), "80 GB")),
    (r"\bA100\b.*\b80GB?\b", _model("NVIDIA-A100-SXM4-80GB", 81_559, (2.04, 312), "80 GB")),
    (r"\bA100\b.*\b40GB?\b", _model("NVIDIA-A100-SXM4-40GB", 40_960, (1.56, 312))),
    (r"\bL40S\b", _model("NVIDIA-L40S", 46_068, (0.86, 362))),
)
# The GPU the plan's default throughputs are figures for.
REFERENCE_GPU = "NVIDIA-H200"


def throughput_scale(model: GpuModel, bound: str) -> tuple[float, str] | None:
    """The factor a default throughput (an H200 figure) takes on `model`, and why: by memory bandwidth for a
    `bound` of "memory" (decoding), by dense bf16 throughput for "compute" (training). None where the model's
    speeds are unknown."""
    reference = lookup(REFERENCE_GPU)
    assert reference is not None and reference.memory_tb_s and reference.bf16_tflops
    if bound == "memory":
        if model.memory_tb_s is None:
            return None
        return (model.memory_tb_s / reference.memory_tb_s,
                f"memory bandwidth {model.memory_tb_s:g} / {reference.memory_tb_s:g} TB/s")
    if model.bf16_tflops is None:
        return None
    return (model.bf16_tflops / reference.bf16_tflops,
            f"dense bf16 {model.bf16_tflops:,g} / {reference.bf16_tflops:,g} TFLOPS")


# The values GPU feature discovery writes to `nvidia.com/gpu.product` for these GPUs (nvidia-smi's name with
# dashes for spaces). A node selector matches a label exactly: "H200" or "nvidia-h200" matches no node.
PRODUCT_LABEL = "nvidia.com/gpu.product"
PRODUCT_LABELS = frozenset({
    "NVIDIA-B200", "NVIDIA-H200", "NVIDIA-H200-NVL", "NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL",
    "NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe", "NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB", "NVIDIA-L40S",
})


def product_label_warning(value: str) -> str | None:
    """Why `value`, set for the GPU product label, may match no node (with the closest label the table knows), or
    None for a label GPU feature discovery writes, or one the table cannot place (a GPU it does not know)."""
    if value in PRODUCT_LABELS:
        return None
    model = lookup(value)
    if model is None:
        return None
    return (f"{value!r} is not a value GPU feature discovery writes to {PRODUCT_LABEL}: no node would match it; "
            f"did you mean {model.name!r}? (`kubectl get nodes -L {PRODUCT_LABEL}` lists your nodes' values)")


def normalise(name: str) -> str:
    text = re.sub(r"[\s_]+", "-", name.strip().upper())
    return re.sub(r"^(NVIDIA-)?(TESLA-)?", "", text)


def lookup(name: str) -> GpuModel | None:
    """The table's entry for a product name (None: not in the table, or a MIG slice)."""
    text = normalise(name)
    if "MIG" in text.split("-"):
        return None
    for pattern, model in TABLE:
        if re.search(pattern, text):
            return model
    return None


def with_memory(name: str, gib: float) -> GpuModel:
    """A GPU of `gib` GiB total memory (`[plan] gpu_memory_gib`), the CUDA context off for the usable figure."""
    total = int(gib * GIB)
    return GpuModel(name, total, max(0, total - CUDA_CONTEXT_BYTES))


def fitting(need: int, usable: bool = True) -> list[GpuModel]:
    """The table's GPUs on which `need` bytes fit (usable memory, or the total with usable=False), smallest
    first: the "a bigger GPU" remedy."""
    models = {model.name: model for _, model in TABLE}.values()
    return sorted((m for m in models if need <= (m.usable if usable else m.total)), key=lambda m: m.total)

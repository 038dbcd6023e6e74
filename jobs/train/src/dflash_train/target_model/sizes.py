"""How many device bytes the target's weights take, read from its files before it is loaded (torch-free: the
stage chooses DDP or FSDP from it before any weight is read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def target_replica_bytes(target_dir: str, loaded_bytes_per_param: int) -> int:
    """Estimated device bytes of the target's weights (file sizes rescaled to the dtype it is loaded in)."""
    stored = 2
    config_path = os.path.join(target_dir, "config.json")
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
        stored = _BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), 2)
    files = sum(p.stat().st_size for p in Path(target_dir).glob("*") if p.suffix in (".safetensors", ".bin"))
    return files * loaded_bytes_per_param // stored

"""Typed config of `dflash-train export` (flags, DFLASH_EXPORT_* variables).

No torch import here: `--help` and config errors are answered before the heavy libraries load, and the
pipeline reads these fields without the train stage's heavy dependencies installed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dflash_shared.settings import StageSettings

ExportDtype = Literal["bfloat16", "float32"]


class ExportConfig(StageSettings):
    """Turn a trained drafter (drafter manifest + checkpoint) into the directory serving engines load."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_EXPORT_")

    drafter: str = Field(description="Drafter prefix written by training (or its manifest.json URI).")
    output: str = Field(
        description="Export prefix: config.json, model.safetensors and a drafter manifest naming the export."
    )
    target: str = Field(description="Target model directory or s3:// prefix; only its config.json is read.")
    checkpoint: str | None = Field(
        default=None, description="Checkpoint to export instead of the manifest's final checkpoint_uri."
    )
    dtype: ExportDtype = Field(default="bfloat16", description="Dtype of the exported weights.")
    speculators: bool = Field(
        default=False,
        description="Also write the speculators format (aux_hidden_state_layer_ids = layer id + 1) under "
        "<output>/speculators.",
    )
    verifier: str | None = Field(
        default=None, description="Target name recorded in the speculators config; defaults to the model id."
    )

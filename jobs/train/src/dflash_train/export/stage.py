"""`dflash-train export`: a training checkpoint -> an export directory and a drafter manifest naming it."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from dflash_shared.errors import BadInputError
from dflash_shared.storage import ObjectStore, join
from dflash_train.drafter.config import DrafterConfig
from dflash_train.export.config import ExportConfig
from dflash_train.export.files import (
    export_drafter,
    load_checkpoint_drafter,
    read_target_config,
    write_speculators_dir,
)
from dflash_train.export.format import CONFIG_NAME, WEIGHTS_NAME, speculators_causality

log = logging.getLogger(__name__)

def check_against_target(cfg: DrafterConfig, target_config: Any, where: str) -> None:
    """Refuse an export the target could not serve (layer count, widths, mask token row)."""
    problems = []
    if int(target_config.num_hidden_layers) != cfg.num_target_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} != target's {target_config.num_hidden_layers}")
    if int(target_config.hidden_size) != cfg.target_hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target's {target_config.hidden_size}")
    if not 0 <= cfg.mask_token_id < int(target_config.vocab_size):
        problems.append(f"mask_token_id {cfg.mask_token_id} is not a row of the {target_config.vocab_size}-row"
                        " target embedding")
    if problems:
        raise BadInputError(f"{where} does not fit the target: " + "; ".join(problems))


def run_export(config: ExportConfig, store: ObjectStore | None = None) -> str:
    """`dflash-train export`: checkpoint -> export directory + a drafter manifest naming it (written last)."""
    from dflash_shared.manifest_io import committed, load_manifest, write_manifest
    from dflash_shared.manifests import Accounting, Kind, Manifest, Shard
    from dflash_shared.provenance import producer
    from dflash_shared.settings import public_dict

    store = store or ObjectStore()
    if done := committed(store, config.output, "export"):
        return done
    loaded = load_manifest(store, config.drafter, Kind.drafter, verify=False)
    section = loaded.section
    checkpoint = config.checkpoint or section.checkpoint_uri
    drafter = load_checkpoint_drafter(store, checkpoint)
    cfg = drafter.config
    recorded = (section.target_layer_ids, section.block_size, section.mask_token_id)
    have = (list(cfg.target_layer_ids), cfg.block_size, cfg.mask_token_id)
    if recorded != have:
        raise BadInputError(f"checkpoint {checkpoint} has (target_layer_ids, block_size, mask_token_id) {have}, "
                            f"its manifest {loaded.uri} says {recorded}")
    target_config = read_target_config(store, config.target)
    check_against_target(cfg, target_config, f"checkpoint {checkpoint}")
    if config.speculators:
        speculators_causality(cfg)  # refuse before anything is written, not after the native export
    written = export_drafter(drafter, target_config, config.output, store, config.dtype)
    if config.speculators:
        with tempfile.TemporaryDirectory(prefix="dflash-speculators-") as tmp:
            verifier = config.verifier or section.target.model_id
            write_speculators_dir(drafter, target_config, tmp, verifier, config.dtype)
            for name in (WEIGHTS_NAME, CONFIG_NAME):
                store.upload_from(os.path.join(tmp, name), join(config.output, "speculators", name))
                written.append(join(config.output, "speculators", name))
    manifest = Manifest(
        kind=Kind.drafter,
        run_id=loaded.manifest.run_id,
        producer=producer("export", public_dict(config), ["dflash-train", "torch", "safetensors"]),
        inputs=[loaded.as_input()],
        shards=[Shard(uri=uri, bytes=store.size(uri), sha256=store.sha256(uri), records=0) for uri in written],
        accounting=Accounting(input_records=1, succeeded=1, failed=0, skipped=0),
        section=section.model_copy(update={"export_uri": config.output, "checkpoint_uri": checkpoint}),
    )
    write_manifest(store, config.output, manifest)
    log.info("exported %s (%s, %d layers, block %d) to %s", checkpoint, config.dtype, cfg.num_layers,
             cfg.block_size, config.output)
    return done

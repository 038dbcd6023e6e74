"""The train stage: a tokenized manifest and a target model in, a trained drafter and its manifest out.

Per rank (torchrun process), four phases: join the process group; prepare the run (`prepare`: the target copied to
local scratch, the input and checkpoint refused where they do not fit, the memory plan checked, the data planned, the
target loaded, the trainer built and resumed from the newest complete checkpoint); train (`trainer`); and on rank 0
write the drafter manifest LAST (`publish`, the commit point). A rerun after the manifest exists does nothing; a
rerun before it continues from the last checkpoint.
"""

from __future__ import annotations

from dflash_shared.manifest_io import committed
from dflash_shared.storage import ObjectStore
from dflash_train.config import TrainConfig
from dflash_train.prepare import TARGET_SMALL_FILES, prepare_run
from dflash_train.publish import PACKAGES, STAGE, publish

__all__ = ["PACKAGES", "STAGE", "TARGET_SMALL_FILES", "run"]


def run(config: TrainConfig, store: ObjectStore | None = None) -> str | None:
    """Train (or resume); returns the drafter manifest URI on rank 0 once written, None elsewhere."""
    from dflash_train.parallel import distributed
    from dflash_train.trainer import Trainer

    store = store or ObjectStore()
    env = distributed.init_distributed(config.device)
    try:
        if done := committed(store, config.output, STAGE):
            return done if env.is_main else None
        prepared = prepare_run(config, store, env)
        try:
            trainer: Trainer = prepared.trainer  # named, so a reader (and a type checker) sees which loop runs
            result = trainer.train()
            return publish(prepared, result, store, env.world_size) if env.is_main else None
        finally:
            prepared.close()
    finally:
        distributed.shutdown(env)

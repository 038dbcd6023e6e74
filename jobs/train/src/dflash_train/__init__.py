"""Train stage of dflash-pipeline: online DFlash drafter training against a frozen target model.

On top, the stage itself: `__main__` (the commands), `config` (TrainConfig), `checks` (preflight), `stage`
(resolve and run) and `trainer` (the loop that wires the parts below). Each subpackage imports only from
the ones listed after it, never from the stage above:
- `evaluate/`: `dflash-train evaluate` (config, prompts, the offline speculative loop, the stage);
- `export/`: `dflash-train export` (config, the export format, its files, the stage);
- `training/`: one step, loss, anchors, optimiser, checkpoints, metrics, the memory plan;
- `target_model/`: the frozen target (features, embedding, LM head), its loading and linear-attention kernels;
- `data/`: packed batches and the shard loader;
- `drafter/`: the drafter's config, attention masks and model;
- `parallel/`: process groups, sharding, and how a rank's failure ends its gang.
torch is imported by the modules that need it, never by a package's `__init__`, so the config modules load
without it.
"""

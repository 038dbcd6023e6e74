"""Train stage of dflash-pipeline: online DFlash drafter training against a frozen target model.

The numerical core lives in these modules (torch is imported only by them, not by this package file):
`drafter_config` (DrafterConfig), `batch` (PackedBatch, packing), `target` (FrozenTarget: features,
embedding, LM head), `anchors` (anchor sampling), `attention` (block-sparse masks, flex and SDPA),
`model` (DFlashDrafter), `loss` (chunked block CE, acceptance length) and `step` (dflash_step).
"""

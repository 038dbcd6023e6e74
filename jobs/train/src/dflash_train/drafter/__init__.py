"""The drafter: its config (presets, validation), block attention masks and the DFlashDrafter model."""

"""One training step and what it needs: loss, anchors, optimiser, checkpoints, metrics, the memory plan."""

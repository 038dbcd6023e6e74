"""The frozen target: hidden-state features, embedding and LM head, loading and sharding, linear kernels."""

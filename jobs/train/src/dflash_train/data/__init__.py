"""Training data: packed batches of tokenized rows, and the loader that reads shards into them."""

"""Assets shared by tests and demos: real Qwen tokenizer directories built offline, and fixtures."""

"""The model: the tiny Qwen3 (tokenizer, build, generation, logprobs) and its published weights."""

"""megatron-sglang-rl: asynchronous RL post-training (LlamaRL design) on Megatron-Core + SGLang."""

__version__ = "0.1.0"

"""Trainer executor: Megatron-Core policy training with TP/PP/DP on gloo or NCCL."""

"""Pure loss and advantage functions (torch only; no torch.distributed, no Megatron)."""

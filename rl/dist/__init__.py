"""Process launch and torch.distributed setup shared by every executor."""

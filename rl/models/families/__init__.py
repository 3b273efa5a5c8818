"""One module per architecture family, each defining ``ARCH`` (see rl/models/registry.py)."""

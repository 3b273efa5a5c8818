"""Model definitions: pure shape logic (shapes.py) and the Megatron builder (megatron_gpt.py)."""

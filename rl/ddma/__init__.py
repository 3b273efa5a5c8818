"""DDMA: every trainer rank sends its own Megatron shards straight into the generator
ranks that need them, in their layout (layout/plan: what goes where; wire: bucket format;
engine: point-to-point transfer; sglang_receiver/sglang_target: into live SGLang servers;
fp8: blockwise quantization; baseline: the gather-to-rank-0 way, for comparison)."""

"""DDMA: every trainer rank sends its own Megatron shards straight into the generator
ranks that need them, in their layout (layout/plan: what goes where; wire: bucket format;
engine: point-to-point transfer; group: the process group trainer and server ranks share;
megatron_source: a trainer rank's live shards; sender: a trainer rank's push into any
target; sglang_receiver: the loader inside a live SGLang server; fp8: blockwise
quantization; baseline: the gather-to-rank-0 way, for comparison). What a server is to
the sender comes from above: the SGLang target is rl/generator/ddma_target.py, and the
controller brackets each version in rl/controller/weight_sync.py."""

"""DDMA: every trainer rank sends its own Megatron shards straight into the generator
ranks that need them, in their layout (layout/plan: what goes where; wire: bucket format;
transport: the one lifecycle every transport implements, with its two kinds in grouped
(point to point over a process group, run by engine or shm) and staged (slots named in
the server's API), and the transports themselves under transports/; group: the process
group trainer and server ranks share; relay: servers forwarding to servers;
megatron_source: a trainer rank's live shards; sender: a trainer rank's push into any
target; sglang_receiver: the loader inside a live SGLang server; fp8: blockwise
quantization). The gather-to-rank-0 baseline it is measured against lives with the
benchmark (tools/bench/ddma_baseline.py). What a server is to the sender comes from
above: the SGLang target is rl/generator/ddma_target.py, and the controller brackets each
version in rl/controller/weight_sync.py."""

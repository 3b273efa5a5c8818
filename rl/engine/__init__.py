"""The Megatron engine every executor that runs a Megatron model shares: the policy's
trainer (rl/trainer) and the critic (rl/critic). A model on this rank's default process
group, its forward and training passes (``trainer.py``), its checkpoints (``checkpoint.py``),
deterministic kernels and MoE counters."""

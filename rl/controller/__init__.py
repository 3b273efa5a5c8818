"""The single controller: the RL loop, evaluation, batch assembly, the rollout stream and
the staleness bound, and each rank's entry into the job (its role and the channels)."""

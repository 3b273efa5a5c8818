"""The single controller: the RL loop, evaluation, batch assembly, the rollout stream and
the staleness bound, the role map and the job's channels."""

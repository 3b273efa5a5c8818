"""The single controller: the RL loop, evaluation, batch assembly, the rollout stream, the
staleness bound and the weight sync. Each rank's entry into the job is rl.runtime.job."""

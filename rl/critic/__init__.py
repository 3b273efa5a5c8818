"""The critic executor: a scalar-head model on ranks of its own, trained beside the policy."""

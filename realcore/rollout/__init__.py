"""The rollout side: the generation-server manager, admission under the staleness bound, and the rollout workers that run episodes."""

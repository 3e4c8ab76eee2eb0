"""The volunteer's rollout node."""

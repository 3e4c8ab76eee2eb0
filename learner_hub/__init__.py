"""The learner hub: admission, activation, dispatch, staleness and the GRPO learner."""

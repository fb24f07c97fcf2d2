"""Planning a job\x27s resources: the train/rollout split (seed 000 Prop. 2) and its simulation."""

"""Planning a job\x27s resources: the train/rollout split (ROLL Flash Prop. 2) and its simulation."""

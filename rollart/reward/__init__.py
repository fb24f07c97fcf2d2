"""Reward-as-a-service: the HTTP server, its client, the sandbox and built-in reward functions."""

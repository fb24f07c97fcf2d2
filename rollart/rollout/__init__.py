"""rollart.rollout"""

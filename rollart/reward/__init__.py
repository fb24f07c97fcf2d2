"""rollart.reward"""

"""rollart.cluster"""

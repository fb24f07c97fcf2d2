"""rollart.training"""

"""rollart.algorithms"""

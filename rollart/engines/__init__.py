"""rollart.engines"""

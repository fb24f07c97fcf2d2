"""rollart.models"""

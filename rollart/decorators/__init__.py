"""rollart.decorators"""

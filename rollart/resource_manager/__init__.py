"""rollart.resource_manager"""

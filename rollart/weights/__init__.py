"""rollart.weights"""

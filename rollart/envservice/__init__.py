"""Environments as services: the env session protocol, its server and client, and the env backends."""

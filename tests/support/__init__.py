"""Helpers shared by tests: real servers (Prometheus), generated TLS material."""
